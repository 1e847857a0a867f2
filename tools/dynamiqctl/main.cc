// dynamiqctl: the operator CLI for dynamiqd (dynamiq.v1.Control and grpc.health.v1 on its --listen
// address). Parses flags into a ctl::Invocation and runs it; the logic lives in ctl.h.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flag_names.h"
#include "kernels/codec_info.h"
#include "tools/dynamiqctl/ctl.h"

// Global flags.
ABSL_FLAG(std::string, daemon, "127.0.0.1:7070", "dynamiqd's operator address (its --listen), host:port.");
ABSL_FLAG(double, timeout, 10, "Deadline in seconds of every RPC to the daemon.");
ABSL_FLAG(std::string, token_file, "",
          "File holding the operator token (dynamiqd --operator_token_file; mode 0600 or stricter), sent as "
          "'authorization: Bearer <token>'. Unset: the DQ_TOKEN_FILE environment variable, if set.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate(s) to verify the daemon's TLS certificate with (dynamiqd --tls_cert); turns TLS on.");
ABSL_FLAG(bool, json, false,
          "Print one JSON object per line instead of tables (protobuf's JSON mapping with the .proto field "
          "names; 64-bit integers are strings).");

// Command flags (unset unless given; a command rejects the flags of other commands).
ABSL_FLAG(std::optional<std::string>, job, std::nullopt,
          "Job id. set-compression: required. flight-recorder: only this job (default: all jobs).");
ABSL_FLAG(std::optional<std::string>, codec, std::nullopt,
          "none, bf16, dynamiq, mxfp8, mxfp6, mxfp4, thc, uniform, int8, global_qsgd, arc_topk or flash. int8 is "
          "INTELLECT-1's codec for DiLoCo pseudo-gradients (per-chunk +-6 sigma clip, 8 bits): on per-step "
          "gradients it clips their heavy tail (vNMSE ~0.3). flash is Flash Communication's group-wise "
          "asymmetric INT-b for the two_shot topology (docs/compressors.md).");
ABSL_FLAG(
    std::optional<double>, bits, std::nullopt,
    absl::StrCat("dynamiq: average bits per coordinate incl. metadata (3..8); uniform, flash: bits per code (2..8); "
                 "thc: 4; global_qsgd: bits per leaf code (2..8, 2^(bits-1)-1 levels per sign); arc_topk: the "
                 "density, the fraction of 256-element rows kept (0.001..1, e.g. 0.05); 0: the codec's default (",
                 dynamiq::kernels::DefaultBitsSummary(),
                 ", as dynamiqd's). The other codecs have no bit setting: --bits with them is refused."));
ABSL_FLAG(std::optional<std::string>, topology, std::nullopt,
          "ring, butterfly (power-of-two node counts) or auto (picked per collective).");
ABSL_FLAG(std::optional<uint64_t>, min_compress_elements, std::nullopt,
          "Tensors with fewer elements go uncompressed (fp32).");
ABSL_FLAG(std::optional<std::string>, allocator, std::nullopt, "dynamiq bit allocator: measured or paper.");
ABSL_FLAG(std::optional<double>, target_vnmse, std::nullopt,
          "Error budget: the compression error (vNMSE) the job may have; node 0's controller picks the lowest DynamiQ "
          "bits that keep the measured error at or under it (docs/error_budget.md). 0: back to fixed bits.");
ABSL_FLAG(std::optional<double>, min_bits, std::nullopt,
          "Error budget: the lowest bits the controller may pick (3..8).");
ABSL_FLAG(std::optional<double>, max_bits, std::nullopt,
          "Error budget: the highest bits the controller may pick (3..8).");
ABSL_FLAG(std::optional<double>, sample_rate, std::nullopt,
          "Error budget: fraction of the job's compressed collectives whose error is measured (0: the daemon's "
          "--error_sample_rate).");
ABSL_FLAG(std::optional<double>, lossy_phase_ms, std::nullopt,
          "The loss-tolerant all-reduce (nodes of dynamiqd --transport=udp; codec none, bf16 or int8): each of its two "
          "phases ends this many milliseconds after a node's sends with what arrived (at most "
          "60000). 0: reliable.");
ABSL_FLAG(std::optional<uint64_t>, expected_epoch, std::nullopt,
          "Fail with ABORTED unless the job's newest config epoch (staged or applied) is this one (optimistic "
          "concurrency).");
ABSL_FLAG(std::optional<uint32_t>, limit, std::nullopt, "Show the most recent N collectives (default: all kept).");
ABSL_FLAG(std::optional<std::string>, service, std::nullopt,
          "Service to check, e.g. dynamiq.v1.Control (default: the whole server).");
ABSL_FLAG(std::optional<double>, interval, std::nullopt, "Seconds between refreshes (default 1).");
ABSL_FLAG(std::optional<uint64_t>, iterations, std::nullopt,
          "Refreshes before exiting (default 0: until interrupted with Ctrl-C).");

namespace {

using dynamiq::ctl::CommandInfo;

constexpr absl::string_view kSummary =
    "dynamiqctl: operator CLI for dynamiqd, the dynamiq per-node daemon. It talks to the daemon's "
    "operator address (--daemon, the daemon's --listen).";

// `text` as lines of at most `width` columns, each starting with `indent`.
std::string Wrap(absl::string_view text, size_t indent, size_t width = 100) {
  std::string out, line(indent, ' ');
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (line.size() > indent && line.size() + 1 + word.size() > width) {
      absl::StrAppend(&out, line, "\n");
      line.assign(indent, ' ');
    }
    absl::StrAppend(&line, line.size() > indent ? " " : "", word);
  }
  return absl::StrCat(out, line, "\n");
}

// One flag's entry, from its ABSL_FLAG definition.
std::string FlagHelp(const std::string& name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if (flag == nullptr) return "";
  std::string text = flag->Help();
  if (!flag->DefaultValue().empty()) absl::StrAppend(&text, " Default: ", flag->DefaultValue(), ".");
  return absl::StrCat("    --", name, "\n", Wrap(text, 8));
}

std::string Help() {
  std::string out = absl::StrCat(kSummary,
                                 "\n\nUsage: dynamiqctl [--daemon=HOST:PORT] [--timeout=SECONDS] [--token_file=PATH] "
                                 "[--tls_ca=PATH] [--json] COMMAND [command flags]\n\nCommands:\n");
  for (const CommandInfo& c : dynamiq::ctl::Commands()) {
    absl::StrAppend(&out, "  ", c.name, "\n", Wrap(c.summary, 4));
    for (const std::string& flag : c.flags) absl::StrAppend(&out, FlagHelp(flag));
  }
  absl::StrAppend(&out, "\nGlobal flags:\n");
  for (const char* flag : {"daemon", "timeout", "token_file", "tls_ca", "json"}) absl::StrAppend(&out, FlagHelp(flag));
  absl::StrAppend(&out, "\n",
                  Wrap("Flag names may be written with dashes or underscores: --target-vnmse is --target_vnmse.", 0),
                  Wrap("Exit status: 0 success; 1 the daemon returned an error (its gRPC code name and message go "
                       "to stderr) or health is not SERVING; 2 usage error.",
                       0),
                  "\nExamples:\n"
                  "  dynamiqctl status\n"
                  "  dynamiqctl --daemon=10.0.0.1:7070 set-compression --job=resnet --codec=dynamiq --bits=4\n"
                  "  dynamiqctl set-compression --job=resnet --target-vnmse=1e-3 --max-bits=7\n"
                  "  dynamiqctl flight-recorder --job=resnet --limit=20 --json\n"
                  "  dynamiqctl health --service=dynamiq.v1.Control\n"
                  "  dynamiqctl --daemon=node1:7070 --tls_ca=ca.pem --token_file=$HOME/.dynamiq/token status\n"
                  "  dynamiqctl top --interval=2\n");
  return out;
}

// absl::ParseCommandLine reports a bad flag (unknown name, unparsable value) on stderr and calls
// std::exit(1); dynamiqctl promises exit status 2 for usage errors, so an exit during parsing
// becomes 2. Not armed for abseil's own --helpfull/--version family, which exit on purpose.
bool g_parsing_flags = false;

void UsageExitDuringParsing() {
  if (!g_parsing_flags) return;
  std::fputs("Run 'dynamiqctl --help' for usage.\n", stderr);
  std::fflush(nullptr);
  std::_Exit(dynamiq::ctl::kExitUsage);
}

bool IsAbseilUsageFlag(absl::string_view arg) {
  for (absl::string_view prefix : {"--help", "-help", "--version", "-version", "--only_check_args"}) {
    if (absl::StartsWith(arg, prefix)) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kSummary);
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) { return absl::StrContains(file, "dynamiqctl"); };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.version_string = [] { return std::string("dynamiqctl " DQ_VERSION "\n"); };
  absl::SetFlagsUsageConfig(usage);

  bool abseil_usage = false;
  for (int i = 1; i < argc && std::string(argv[i]) != "--"; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-help" || arg == "-h") {
      std::cout << Help();
      return dynamiq::ctl::kExitOk;
    }
    abseil_usage |= IsAbseilUsageFlag(arg);
  }
  // --metrics-port is --metrics_port: flag names may be spelled with dashes.
  std::vector<std::string> normalized = dynamiq::common::FlagNamesWithUnderscores(argc, argv);
  std::vector<char*> args;
  for (std::string& a : normalized) args.push_back(a.data());
  argc = static_cast<int>(args.size());
  argv = args.data();
  std::atexit(UsageExitDuringParsing);
  g_parsing_flags = !abseil_usage;
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  g_parsing_flags = false;

  dynamiq::ctl::Invocation in;
  in.args.assign(positional.begin() + 1, positional.end());
  if (in.args.size() == 1 && in.args[0] == "help") {
    std::cout << Help();
    return dynamiq::ctl::kExitOk;
  }
  in.connect.daemon = absl::GetFlag(FLAGS_daemon);
  const double timeout = absl::GetFlag(FLAGS_timeout);
  // Bound it so the conversion cannot overflow; a day is longer than any sane RPC.
  in.connect.timeout = timeout > 0 ? absl::Seconds(std::min(timeout, 86400.0)) : absl::ZeroDuration();
  std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (const char* env = std::getenv("DQ_TOKEN_FILE"); token_file.empty() && env != nullptr) token_file = env;
  if (absl::Status s = dynamiq::ctl::LoadCredentials(token_file, absl::GetFlag(FLAGS_tls_ca), in.connect); !s.ok()) {
    std::cerr << "dynamiqctl: " << dynamiq::ctl::FormatError(s) << "\n";
    return dynamiq::ctl::kExitFailure;
  }
  in.json = absl::GetFlag(FLAGS_json);
  in.job = absl::GetFlag(FLAGS_job);
  in.compression.codec = absl::GetFlag(FLAGS_codec);
  in.compression.bits = absl::GetFlag(FLAGS_bits);
  in.compression.topology = absl::GetFlag(FLAGS_topology);
  in.compression.min_compress_elements = absl::GetFlag(FLAGS_min_compress_elements);
  in.compression.allocator = absl::GetFlag(FLAGS_allocator);
  in.compression.target_vnmse = absl::GetFlag(FLAGS_target_vnmse);
  in.compression.min_bits = absl::GetFlag(FLAGS_min_bits);
  in.compression.max_bits = absl::GetFlag(FLAGS_max_bits);
  in.compression.sample_rate = absl::GetFlag(FLAGS_sample_rate);
  in.compression.lossy_phase_ms = absl::GetFlag(FLAGS_lossy_phase_ms);
  in.compression.expected_epoch = absl::GetFlag(FLAGS_expected_epoch);
  in.limit = absl::GetFlag(FLAGS_limit);
  in.service = absl::GetFlag(FLAGS_service);
  in.interval = absl::GetFlag(FLAGS_interval);
  in.iterations = absl::GetFlag(FLAGS_iterations);
  in.terminal = isatty(STDOUT_FILENO) == 1;
  return dynamiq::ctl::Run(in, std::cout, std::cerr);
}
