// dynamiq-linkem: the link emulator of the network benchmarks and tests (docs/testing.md, "Wide-area
// links"): what this kernel lacks for delay and loss (no netem), on network devices that exist.
//
//   dynamiq-linkem delay --pairs=A:B[,C:D...] --delay_ab=D --delay_ba=D [--jitter=J] [--seed=N]
//       forwards frames between each pair of devices with a one-way delay per direction (a->b,
//       b->a) until SIGTERM/SIGINT; then prints per-direction counters
//   dynamiq-linkem loss --dev=X --loss=SPEC [--seed=N] [--ingress]
//       attaches random loss to X's egress (or ingress) (an eBPF filter; stays after exit)
//   dynamiq-linkem profile NAME    prints a named profile as shell assignments
//   dynamiq-linkem profiles        lists the profiles
//   dynamiq-linkem check [--delay_ab=D] [--delay_ba=D] [--jitter=J] [--loss=SPEC] [--print_ms]
//       validates settings (exit status 2 and a message when one is impossible); --print_ms
//       prints --delay_ab in milliseconds
#include <errno.h>
#include <sched.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tools/linkem/delay_line.h"
#include "tools/linkem/link_settings.h"
#include "tools/linkem/loss_filter.h"

ABSL_FLAG(std::string, pairs, "", "delay: device pairs A:B, comma-separated (a frame A receives leaves by B)");
ABSL_FLAG(std::string, delay_ab, "0", "delay, check: one-way delay from each pair's A to its B (e.g. 37.5ms)");
ABSL_FLAG(std::string, delay_ba, "0", "delay, check: one-way delay from B to A");
ABSL_FLAG(std::string, jitter, "0", "delay, check: standard deviation of each direction's delay (no reordering)");
ABSL_FLAG(bool, realtime, true,
          "delay: run at real-time priority (SCHED_FIFO 10) where allowed, so that busy CPUs do not add delay");
ABSL_FLAG(uint64_t, queue_mib, 64, "delay: the most each direction holds (frames past it are dropped)");
ABSL_FLAG(std::string, dev, "", "loss: the device whose egress loses packets");
ABSL_FLAG(bool, ingress, false, "loss: drop what --dev receives instead of what it sends");
ABSL_FLAG(std::string, loss, "0", "loss, check: P (Bernoulli) or ge:P_GB,P_BG[,LOSS_BAD[,LOSS_GOOD]] (bursts)");
ABSL_FLAG(bool, print_ms, false, "check: print --delay_ab in milliseconds (for scripts)");
ABSL_FLAG(uint64_t, seed, 1, "delay, loss: seed of the jitter / loss generators");

namespace {

using dynamiq::linkem::DelayLine;

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "dynamiq-linkem: %s\n", std::string(s.message()).c_str());
  return 2;
}

absl::StatusOr<dynamiq::linkem::DirectionSettings> Direction(const std::string& flag, const std::string& value) {
  absl::StatusOr<absl::Duration> delay = dynamiq::linkem::ParseDelay(value, flag);
  if (!delay.ok()) return delay.status();
  absl::StatusOr<absl::Duration> jitter = dynamiq::linkem::ParseDelay(absl::GetFlag(FLAGS_jitter), "--jitter");
  if (!jitter.ok()) return jitter.status();
  return dynamiq::linkem::DirectionSettings{*delay, *jitter};
}

int Delay() {
  dynamiq::linkem::DelayLineOptions o;
  auto ab = Direction("--delay_ab", absl::GetFlag(FLAGS_delay_ab));
  if (!ab.ok()) return Fail(ab.status());
  auto ba = Direction("--delay_ba", absl::GetFlag(FLAGS_delay_ba));
  if (!ba.ok()) return Fail(ba.status());
  for (absl::string_view pair : absl::StrSplit(absl::GetFlag(FLAGS_pairs), ',', absl::SkipEmpty())) {
    std::vector<std::string> ends = absl::StrSplit(pair, ':');
    if (ends.size() != 2 || ends[0].empty() || ends[1].empty()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("--pairs: '", pair, "' is not A:B")));
    }
    o.pairs.push_back({ends[0], ends[1], *ab, *ba});
  }
  o.seed = absl::GetFlag(FLAGS_seed);
  o.queue_bytes = absl::GetFlag(FLAGS_queue_mib) << 20;
  auto line = DelayLine::Open(o);
  if (!line.ok()) return Fail(line.status());
  signal(SIGTERM, OnSignal);
  signal(SIGINT, OnSignal);
  if (absl::GetFlag(FLAGS_realtime)) {
    // On a machine whose cores are busy (ranks computing, tests in parallel) a normal-priority line
    // wakes late and adds milliseconds of delay nobody asked for.
    sched_param priority{};
    priority.sched_priority = 10;
    if (sched_setscheduler(0, SCHED_FIFO, &priority) != 0) {
      std::fprintf(stderr, "dynamiq-linkem: warning: no real-time priority (%s); busy CPUs will add delay\n",
                   std::strerror(errno));
    }
  }
  std::fprintf(stderr, "dynamiq-linkem: delay line up (%zu pairs)\n", o.pairs.size());
  const absl::Status ran = (*line)->Run(g_stop);
  for (const DelayLine::DirectionStats& s : (*line)->stats()) {
    std::printf(
        "{\"from\": \"%s\", \"to\": \"%s\", \"frames\": %llu, \"bytes\": %llu, \"dropped_full\": %llu, "
        "\"send_errors\": %llu, \"max_queued_bytes\": %zu}\n",
        s.from.c_str(), s.to.c_str(), static_cast<unsigned long long>(s.frames),
        static_cast<unsigned long long>(s.bytes), static_cast<unsigned long long>(s.dropped_full),
        static_cast<unsigned long long>(s.send_errors), s.max_queued_bytes);
  }
  std::fflush(stdout);
  return ran.ok() ? 0 : Fail(ran);
}

int Loss() {
  auto loss = dynamiq::linkem::ParseLoss(absl::GetFlag(FLAGS_loss));
  if (!loss.ok()) return Fail(loss.status());
  if (absl::GetFlag(FLAGS_dev).empty()) return Fail(absl::InvalidArgumentError("loss: --dev is required"));
  const absl::Status s = dynamiq::linkem::AttachLossFilter(
      absl::GetFlag(FLAGS_dev), *loss, absl::GetFlag(FLAGS_seed),
      absl::GetFlag(FLAGS_ingress) ? dynamiq::linkem::LossSide::kIngress : dynamiq::linkem::LossSide::kEgress);
  return s.ok() ? 0 : Fail(s);
}

int Check() {
  for (const auto& [flag, value] : {std::pair<std::string, std::string>{"--delay_ab", absl::GetFlag(FLAGS_delay_ab)},
                                    {"--delay_ba", absl::GetFlag(FLAGS_delay_ba)},
                                    {"--jitter", absl::GetFlag(FLAGS_jitter)}}) {
    if (auto d = dynamiq::linkem::ParseDelay(value, flag); !d.ok()) return Fail(d.status());
  }
  if (auto l = dynamiq::linkem::ParseLoss(absl::GetFlag(FLAGS_loss)); !l.ok()) return Fail(l.status());
  if (absl::GetFlag(FLAGS_print_ms)) {
    std::printf("%.6f\n", absl::ToDoubleMilliseconds(*dynamiq::linkem::ParseDelay(absl::GetFlag(FLAGS_delay_ab), "")));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the link emulator: delay, jitter and loss on existing network devices.\n"
      "  dynamiq-linkem delay --pairs=A:B[,C:D] --delay_ab=D --delay_ba=D [--jitter=J] [--seed=N]\n"
      "  dynamiq-linkem loss --dev=X --loss=P|ge:P_GB,P_BG[,LOSS_BAD[,LOSS_GOOD]] [--seed=N] [--ingress]\n"
      "  dynamiq-linkem profile NAME | profiles\n"
      "  dynamiq-linkem check [--delay_ab=D] [--delay_ba=D] [--jitter=J] [--loss=SPEC]\n"
      "Needs root (AF_PACKET, eBPF). docs/testing.md, \"Wide-area links\".");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string command = args.size() > 1 ? args[1] : "";
  if (command == "delay") return Delay();
  if (command == "loss") return Loss();
  if (command == "check") return Check();
  if (command == "profiles") {
    for (const auto& p : dynamiq::linkem::Profiles()) std::printf("%-16s %s\n", p.name.c_str(), p.what.c_str());
    return 0;
  }
  if (command == "profile" && args.size() == 3) {
    auto p = dynamiq::linkem::FindProfile(args[2]);
    if (!p.ok()) return Fail(p.status());
    std::printf("rate=%s rtt_ms=%g jitter_ms=%g loss=%s\n", p->rate.c_str(), absl::ToDoubleMilliseconds(p->rtt),
                absl::ToDoubleMilliseconds(p->jitter), p->loss.c_str());
    return 0;
  }
  std::fprintf(stderr, "dynamiq-linkem: a command: delay, loss, profile NAME, profiles or check (--help)\n");
  return 2;
}
