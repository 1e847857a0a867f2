#include "tools/dynamiqctl/ctl.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "kernels/codec_info.h"

namespace dynamiq::ctl {
namespace {

using dynamiq::v1::CollectiveRecord;
using dynamiq::v1::CompressionConfig;
using grpc::health::v1::HealthCheckResponse;

// A left/right-aligned text table: columns two spaces apart, no trailing blanks.
class Table {
 public:
  struct Column {
    std::string header;
    bool right = false;  // numbers
  };
  explicit Table(std::vector<Column> columns) : columns_(std::move(columns)) {}

  void AddRow(std::vector<std::string> cells) {
    cells.resize(columns_.size());
    rows_.push_back(std::move(cells));
  }

  std::string Render() const {
    std::vector<size_t> width(columns_.size());
    for (size_t c = 0; c < columns_.size(); ++c) {
      width[c] = columns_[c].header.size();
      for (const auto& row : rows_) width[c] = std::max(width[c], row[c].size());
    }
    std::string out;
    auto line = [&](const std::vector<std::string>& cells) {
      std::string text;
      for (size_t c = 0; c < cells.size(); ++c) {
        if (c > 0) text += "  ";
        const std::string pad(width[c] - cells[c].size(), ' ');
        absl::StrAppend(&text, columns_[c].right ? pad : "", cells[c], columns_[c].right ? "" : pad);
      }
      text.erase(text.find_last_not_of(' ') + 1);
      absl::StrAppend(&out, text, "\n");
    };
    std::vector<std::string> headers;
    for (const Column& c : columns_) headers.push_back(c.header);
    line(headers);
    for (const auto& row : rows_) line(row);
    return out;
  }

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

// One line of protobuf's canonical JSON with the .proto field names and every field present.
std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) return absl::StrCat("{\"error\":", "\"cannot print ", message.GetTypeName(), " as JSON\"}");
  return json;
}

// A JSON string literal.
std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string Bits(double bits) { return absl::StrFormat("%g", bits); }
// `top` cuts longer job ids (ending them with '~') so that its table fits 80 columns.
constexpr size_t kTopJobWidth = 12;
// A job's bits as the status table shows them: "-" for codecs that have no bit setting.
std::string CodecBits(const CompressionConfig& c) {
  absl::StatusOr<kernels::CodecId> id = kernels::ParseCodecId(c.codec());
  return id.ok() && !kernels::GetCodecInfo(*id).has_bits ? "-" : Bits(c.bits());
}

std::string DescribeConfig(const CompressionConfig& c) {
  std::string s = absl::StrCat("codec=", c.codec(), " bits=", c.bits() == 0 ? "default" : Bits(c.bits()),
                               " topology=", c.topology(), " min_compress_elements=", c.min_compress_elements(),
                               " allocator=", c.allocator().empty() ? "measured" : c.allocator());
  if (c.error_budget().target_vnmse() > 0) {
    const dynamiq::v1::ErrorBudget& b = c.error_budget();
    absl::StrAppend(&s, " target_vnmse=", absl::StrFormat("%g", b.target_vnmse()), " bits_range=[",
                    Bits(b.min_bits() == 0 ? 3 : b.min_bits()), ",", Bits(b.max_bits() == 0 ? 8 : b.max_bits()), "]");
    if (b.sample_rate() > 0) absl::StrAppend(&s, " sample_rate=", absl::StrFormat("%g", b.sample_rate()));
  }
  if (c.lossy_phase_ms() > 0) absl::StrAppend(&s, " lossy_phase_ms=", absl::StrFormat("%g", c.lossy_phase_ms()));
  return s;
}

// Table cells hold one line.
std::string OneLine(absl::string_view s) { return absl::StrReplaceAll(s, {{"\r\n", " "}, {"\n", " "}, {"\r", " "}}); }

// The command flags an invocation gave.
std::vector<std::string> GivenCommandFlags(const Invocation& in) {
  std::vector<std::string> given;
  if (in.job) given.push_back("job");
  if (in.compression.codec) given.push_back("codec");
  if (in.compression.bits) given.push_back("bits");
  if (in.compression.topology) given.push_back("topology");
  if (in.compression.min_compress_elements) given.push_back("min_compress_elements");
  if (in.compression.allocator) given.push_back("allocator");
  if (in.compression.target_vnmse) given.push_back("target_vnmse");
  if (in.compression.min_bits) given.push_back("min_bits");
  if (in.compression.max_bits) given.push_back("max_bits");
  if (in.compression.sample_rate) given.push_back("sample_rate");
  if (in.compression.lossy_phase_ms) given.push_back("lossy_phase_ms");
  if (in.compression.expected_epoch) given.push_back("expected_epoch");
  if (in.limit) given.push_back("limit");
  if (in.service) given.push_back("service");
  if (in.interval) given.push_back("interval");
  if (in.iterations) given.push_back("iterations");
  return given;
}

int UsageError(std::ostream& err, absl::string_view message) {
  err << "dynamiqctl: " << message << "\nRun 'dynamiqctl --help' for usage.\n";
  return kExitUsage;
}

int Failure(std::ostream& err, const absl::Status& status) {
  err << "dynamiqctl: " << FormatError(status) << "\n";
  return kExitFailure;
}

}  // namespace

std::string FormatStatus(const dynamiq::v1::GetStatusResponse& status, bool json) {
  if (json) return ToJson(status) + "\n";
  std::vector<std::string> members;
  bool forming = false;  // before the cluster forms a node knows only its own place
  for (int i = 0; i < status.members_size(); ++i) {
    forming |= status.members(i).empty();
    members.push_back(absl::StrCat(i, "=", status.members(i).empty() ? "-" : status.members(i)));
  }
  std::string out =
      absl::StrCat("node     ", status.node_rank(), " of ", status.num_nodes(), "\n", "version  ", status.version(),
                   status.git_commit().empty() ? "" : absl::StrCat(" (", status.git_commit(), ")"), "\n", "members  ",
                   members.empty() ? "-" : absl::StrJoin(members, " "),
                   forming ? " (the cluster has not formed yet: - has not joined)" : "", "\n");
  if (!status.transport().empty()) {
    absl::StrAppend(&out, "device   ", status.device(), ", transport ", status.transport(), " between nodes\n");
  }
  if (status.live_nodes_size() > 0 && static_cast<uint32_t>(status.live_nodes_size()) < status.num_nodes()) {
    std::vector<uint32_t> silent;
    for (uint32_t node = 0; node < status.num_nodes(); ++node) {
      if (std::find(status.live_nodes().begin(), status.live_nodes().end(), node) == status.live_nodes().end()) {
        silent.push_back(node);
      }
    }
    absl::StrAppend(&out, "live     nodes ", absl::StrJoin(status.live_nodes(), ", "),
                    "; silent (no heartbeat): ", absl::StrJoin(silent, ", "), "\n");
  }
  if (!status.metrics_address().empty()) {
    absl::StrAppend(&out, "metrics  http://", status.metrics_address(), "/metrics (error sample rate ",
                    absl::StrFormat("%g", status.error_sample_rate()), ")\n");
  }
  out += "\n";
  if (status.jobs().empty()) return out + "no jobs\n";
  Table table({{"JOB"},
               {"INCARNATION", true},
               {"WORKERS", true},
               {"EPOCH", true},
               {"CODEC"},
               {"BITS", true},
               {"TOPOLOGY"},
               {"MIN COMPRESS", true},
               {"INFLIGHT", true},
               {"COMPLETED", true},
               {"TARGET VNMSE", true}});
  std::string budgets;
  for (const auto& j : status.jobs()) {
    const dynamiq::v1::ErrorBudget& budget = j.config().error_budget();
    table.AddRow({OneLine(j.job_id()), absl::StrCat(j.incarnation()), absl::StrCat(j.workers()),
                  // One node sums locally: no topology (as the metrics' topology="local").
                  absl::StrCat(j.config_epoch()), j.config().codec(), CodecBits(j.config()),
                  status.num_nodes() <= 1 ? std::string("local") : j.config().topology(),
                  absl::StrCat(j.config().min_compress_elements()), absl::StrCat(j.inflight()),
                  absl::StrCat(j.completed()),
                  budget.target_vnmse() > 0 ? absl::StrFormat("%g", budget.target_vnmse()) : "-"});
    if (j.view_epoch() > 0) {
      // Nodes went silent (or an operator left some out): the job runs on fewer than every node.
      absl::StrAppend(&budgets, "job ", OneLine(j.job_id()), ": view ", j.view_epoch(), ", runs on nodes ",
                      absl::StrJoin(j.view_nodes(), ", "), " (", j.view_nodes_size(), " of ", status.num_nodes(),
                      ")\n");
    }
    if (j.has_error_budget()) {
      const dynamiq::v1::ErrorBudgetStatus& b = j.error_budget();
      absl::StrAppend(&budgets, "job ", OneLine(j.job_id()), ": error budget ",
                      absl::StrFormat("%g", budget.target_vnmse()), ", bits ", Bits(b.bits()), " in [",
                      Bits(budget.min_bits()), ", ", Bits(budget.max_bits()), "], last sample ",
                      absl::StrFormat("%.3g", b.last_vnmse()), " (", b.samples_used(), " used, ", b.samples_stale(),
                      " stale), ", b.raises(), " raises, ", b.lowers(), " lowers, ", b.rejected(), " rejected",
                      b.saturated() ? ", SATURATED at max bits" : "", "\n");
    }
  }
  return out + table.Render() + (budgets.empty() ? "" : "\n" + budgets);
}

std::string FormatCompressionChange(const CompressionChangeResult& result, bool json) {
  if (json) {
    return absl::StrCat("{\"job_id\":", JsonString(result.job_id), ",\"epoch\":\"", result.epoch,
                        "\",\"config\":", ToJson(result.config), "}\n");
  }
  return absl::StrCat("job ", result.job_id, ": ", DescribeConfig(result.config), "\napplies at config epoch ",
                      result.epoch, " (every node switches at the same collective boundary)\n");
}

std::string FormatFlightRecorder(const dynamiq::v1::GetFlightRecorderResponse& records, bool json) {
  if (json) {
    std::string out;
    for (const CollectiveRecord& r : records.records()) absl::StrAppend(&out, ToJson(r), "\n");
    for (const auto& e : records.error_budget_events()) absl::StrAppend(&out, ToJson(e), "\n");
    return out;
  }
  std::string events;
  if (!records.error_budget_events().empty()) {
    Table table(
        {{"TIME"}, {"JOB"}, {"EVENT"}, {"BITS"}, {"MEASURED", true}, {"TARGET", true}, {"EPOCH", true}, {"REASON"}});
    for (const auto& e : records.error_budget_events()) {
      table.AddRow({absl::FormatTime("%H:%M:%E3S", absl::FromUnixNanos(e.time_unix_nanos()), absl::LocalTimeZone()),
                    OneLine(e.job_id()), e.kind(), absl::StrCat(Bits(e.from_bits()), "->", Bits(e.bits())),
                    absl::StrFormat("%.3g", e.measured_vnmse()), absl::StrFormat("%.3g", e.target_vnmse()),
                    e.epoch() == 0 ? "-" : absl::StrCat(e.epoch()), OneLine(e.reason())});
    }
    events = absl::StrCat("\nerror-budget controller events:\n", table.Render());
  }
  if (records.records().empty()) return "no collectives recorded\n" + events;
  Table table({{"SEQ", true},
               {"JOB"},
               {"TENSOR"},
               {"ELEMENTS", true},
               {"CODEC/BITS"},
               {"EPOCH", true},
               {"STATE"},
               {"SECONDS", true},
               {"WIRE BYTES", true},
               {"ERROR"}});
  for (const CollectiveRecord& r : records.records()) {
    table.AddRow({absl::StrCat(r.sequence()), OneLine(r.job_id()), OneLine(r.tensor_name()),
                  absl::StrCat(r.num_elements()), absl::StrCat(r.config().codec(), "/", Bits(r.config().bits())),
                  absl::StrCat(r.config_epoch()), r.state(), absl::StrFormat("%.6f", r.seconds()),
                  absl::StrCat(r.wire_bytes()), r.error().empty() ? "-" : OneLine(r.error())});
  }
  return table.Render() + events;
}

std::string FormatHealth(const std::string& service, HealthCheckResponse::ServingStatus status, bool json) {
  const std::string name = HealthCheckResponse::ServingStatus_Name(status);
  if (json) return absl::StrCat("{\"service\":", JsonString(service), ",\"status\":", JsonString(name), "}\n");
  return name + "\n";
}

namespace {

// Counter growth between two answers; a counter that went backwards (daemon restarted) restarts
// from zero.
template <typename T>
T Delta(T current, T previous) {
  return current >= previous ? current - previous : current;
}

std::string MegabytesPerSecond(std::optional<double> bytes_per_second) {
  return bytes_per_second ? absl::StrFormat("%.1f", *bytes_per_second / 1e6) : "-";
}

// "dynamiq/5", "arc_topk/0.1"; a codec without a bit setting alone ("int8"); "-" when unknown.
std::string TopCodec(const std::string& codec, double bits) {
  absl::StatusOr<kernels::CodecId> id = kernels::ParseCodecId(codec);
  if (!id.ok()) return codec.empty() ? "-" : codec;
  return kernels::GetCodecInfo(*id).has_bits ? absl::StrCat(codec, "/", Bits(bits)) : codec;
}

std::string JsonNumber(std::optional<double> v) { return v ? absl::StrFormat("%.9g", *v) : "null"; }

}  // namespace

std::vector<TopRow> TopRows(const dynamiq::v1::GetStatusResponse& previous,
                            const dynamiq::v1::GetStatusResponse& current, double seconds) {
  std::vector<TopRow> rows;
  for (const dynamiq::v1::JobStatus& j : current.jobs()) {
    dynamiq::v1::JobStatus before;  // zeros for a job that was not there yet (or another incarnation)
    for (const dynamiq::v1::JobStatus& p : previous.jobs()) {
      if (p.job_id() == j.job_id() && p.incarnation() == j.incarnation()) before = p;
    }
    TopRow r;
    r.job_id = j.job_id();
    r.codec = j.config().codec();
    r.bits = j.config().bits();
    r.config_epoch = j.config_epoch();
    r.workers = j.workers();
    r.inflight = j.inflight();
    r.seconds = seconds;
    r.collectives = Delta(j.completed(), before.completed());
    r.failed = Delta(j.failed(), before.failed());
    const uint64_t payload = Delta(j.payload_bytes(), before.payload_bytes());
    const uint64_t bus = Delta(j.bus_bytes(), before.bus_bytes());
    const uint64_t wire = Delta(j.wire_bytes(), before.wire_bytes());
    const double busy = j.duration_seconds_sum() >= before.duration_seconds_sum()
                            ? j.duration_seconds_sum() - before.duration_seconds_sum()
                            : j.duration_seconds_sum();
    if (seconds > 0) {
      r.collectives_per_second = r.collectives / seconds;
      r.wire_bytes_per_second = wire / seconds;
    }
    if (r.collectives > 0 && busy > 0) {
      r.algbw = payload / busy;
      if (current.num_nodes() > 1) r.busbw = bus / busy;
    }
    if (wire > 0) r.compression_ratio = static_cast<double>(bus) / wire;
    const uint64_t expected = Delta(j.lossy_datagrams_expected(), before.lossy_datagrams_expected());
    const uint64_t arrived = Delta(j.lossy_datagrams_arrived(), before.lossy_datagrams_arrived());
    if (expected > 0) r.loss = 1.0 - static_cast<double>(std::min(arrived, expected)) / expected;
    r.drift_elements = j.lossy_drift_elements();
    if (j.error_samples() > 0) r.last_vnmse = j.last_vnmse();
    r.error_samples = j.error_samples();
    // Whom the interval's collectives waited for longest: a node, else a local rank.
    auto longest = [](const google::protobuf::Map<uint32_t, double>& now,
                      const google::protobuf::Map<uint32_t, double>& then) -> std::pair<int64_t, double> {
      std::pair<int64_t, double> best{-1, 0.0};
      for (const auto& [rank, seconds] : now) {
        auto it = then.find(rank);
        const double waited = seconds - (it != then.end() && it->second <= seconds ? it->second : 0.0);
        if (waited > best.second) best = {rank, waited};
      }
      return best;
    };
    const auto node = longest(j.node_wait_seconds(), before.node_wait_seconds());
    const auto local = longest(j.local_wait_seconds(), before.local_wait_seconds());
    if (node.first >= 0) {
      r.slowest = absl::StrCat("node ", node.first);
      r.slowest_wait_seconds = node.second;
    } else if (local.first >= 0) {
      r.slowest = absl::StrCat("rank ", local.first);
      r.slowest_wait_seconds = local.second;
    }
    rows.push_back(std::move(r));
  }
  return rows;
}

std::string FormatTop(const dynamiq::v1::GetStatusResponse& status, const std::vector<TopRow>& rows, bool json,
                      bool terminal, absl::Time now) {
  const std::string time = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", now, absl::UTCTimeZone());
  if (json) {
    std::string out;
    for (const TopRow& r : rows) {
      absl::StrAppend(
          &out, "{\"time\":\"", time, "\",\"node_rank\":", status.node_rank(), ",\"job_id\":", JsonString(r.job_id),
          ",\"codec\":", JsonString(r.codec), ",\"bits\":", JsonNumber(r.bits), ",\"config_epoch\":\"", r.config_epoch,
          "\",\"workers\":", r.workers, ",\"inflight\":", r.inflight, ",\"interval_seconds\":", JsonNumber(r.seconds),
          ",\"collectives\":\"", r.collectives, "\",\"failed\":\"", r.failed,
          "\",\"collectives_per_second\":", JsonNumber(r.collectives_per_second),
          ",\"algbw_bytes_per_second\":", JsonNumber(r.algbw), ",\"busbw_bytes_per_second\":", JsonNumber(r.busbw),
          ",\"wire_bytes_per_second\":", JsonNumber(r.wire_bytes_per_second),
          ",\"compression_ratio\":", JsonNumber(r.compression_ratio), ",\"last_vnmse\":", JsonNumber(r.last_vnmse),
          ",\"error_samples\":\"", r.error_samples, "\",\"slowest\":", JsonString(r.slowest),
          ",\"slowest_wait_seconds\":", JsonNumber(r.slowest_wait_seconds), ",\"loss\":", JsonNumber(r.loss),
          ",\"drift_elements\":\"", r.drift_elements, "\"}\n");
    }
    return out;
  }
  std::string out = terminal ? "\x1b[H\x1b[2J" : "";
  absl::StrAppend(&out, "dynamiqctl top  node ", status.node_rank(), " of ", status.num_nodes(), "  ", time);
  if (rows.empty()) return out + "\nno jobs\n";
  absl::StrAppend(&out, absl::StrFormat("  (%.1f s, MB/s)\n", rows[0].seconds));
  // Two tables, so that every figure fits an 80-column terminal: the job (codec/bits, config epoch,
  // workers, collectives in flight, collectives/s and failures in the interval), then its bandwidths
  // (algbw, busbw, wire; MB/s), compression ratio, last measured vNMSE and the node or local rank
  // its collectives waited for longest in the interval (seconds in all).
  Table job_table({{"JOB"},
                   {"CODEC"},
                   {"EPOCH", true},
                   {"WORKERS", true},
                   {"INFL", true},
                   {"COLL/S", true},
                   {"FAIL", true},
                   {"LOSS", true}});
  Table rate_table(
      {{"JOB"}, {"ALGBW", true}, {"BUSBW", true}, {"WIRE", true}, {"RATIO", true}, {"VNMSE", true}, {"WAITED FOR"}});
  for (const TopRow& r : rows) {
    std::string job = OneLine(r.job_id);
    if (job.size() > kTopJobWidth) job = absl::StrCat(job.substr(0, kTopJobWidth - 1), "~");
    job_table.AddRow({job, TopCodec(r.codec, r.bits), absl::StrCat(r.config_epoch), absl::StrCat(r.workers),
                      absl::StrCat(r.inflight), absl::StrFormat("%.1f", r.collectives_per_second),
                      absl::StrCat(r.failed), r.loss ? absl::StrFormat("%.1f%%", 100 * *r.loss) : "-"});
    rate_table.AddRow({job, MegabytesPerSecond(r.algbw), MegabytesPerSecond(r.busbw),
                       MegabytesPerSecond(r.wire_bytes_per_second),
                       r.compression_ratio ? absl::StrFormat("%.2fx", *r.compression_ratio) : "-",
                       r.last_vnmse ? absl::StrFormat("%.2e", *r.last_vnmse) : "-",
                       r.slowest.empty() ? "-" : absl::StrFormat("%s %.2fs", r.slowest, r.slowest_wait_seconds)});
  }
  return out + job_table.Render() + rate_table.Render();
}

std::string FormatError(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
}

const std::vector<CommandInfo>& Commands() {
  static const auto* commands = new std::vector<CommandInfo>{
      {"status", "The node (rank, cluster size, members, version) and a table of its jobs.", {}},
      {"set-compression",
       "Stages a job's compression change and prints the config epoch at which every node applies it. "
       "Flags not given keep the job's newest values (dynamiqd merges the change into them, a staged change "
       "included; the complete configuration is printed); a new --codec without "
       "--bits gets that codec's default bits (the same as dynamiqd's), and a codec without a bit setting "
       "(none, bf16, mxfp8, mxfp6, mxfp4, int8) refuses --bits. --target_vnmse puts the job under an error budget: "
       "node 0's "
       "controller then picks DynamiQ's bits itself (docs/error_budget.md); --bits without it returns to "
       "fixed bits. --lossy_phase_ms above 0 switches the job to the loss-tolerant all-reduce (dynamiqd "
       "--transport=udp, codec none, bf16 or int8), 0 back to the reliable one.",
       {"job", "codec", "bits", "topology", "min_compress_elements", "allocator", "target_vnmse", "min_bits",
        "max_bits", "sample_rate", "lossy_phase_ms", "expected_epoch"}},
      {"flight-recorder",
       "The node's most recent collectives, oldest first, then (on node 0) the error-budget controller's events.",
       {"job", "limit"}},
      {"health", "grpc.health.v1 Check: prints SERVING or NOT_SERVING; exits 0 only when SERVING.", {"service"}},
      {"top",
       "A live view of the node's jobs, refreshed every --interval seconds: collectives/s, algbw and busbw "
       "(bytes over time spent in collectives), wire MB/s, compression ratio (bus bytes / wire bytes), the "
       "loss-tolerant all-reduce's loss (datagrams from other nodes that missed their deadline), the last "
       "measured vNMSE, whom the collectives waited for longest (the slowest node, else local rank), codec/bits, "
       "config epoch, workers and in-flight collectives (two tables per refresh, to fit 80 columns). --json prints one "
       "object per job per refresh. Runs until interrupted unless "
       "--iterations is given.",
       {"interval", "iterations"}},
  };
  return *commands;
}

namespace {

int RunTop(const ControlClient& client, const Invocation& in, std::ostream& out, std::ostream& err) {
  const double interval = in.interval.value_or(1.0);
  // Bounded so the conversion cannot overflow; a day between refreshes is no live view.
  if (!(interval > 0) || interval > 86400) return UsageError(err, "--interval must be in (0, 86400] seconds");
  const uint64_t iterations = in.iterations.value_or(0);
  absl::StatusOr<dynamiq::v1::GetStatusResponse> previous = client.GetStatus();
  if (!previous.ok()) return Failure(err, previous.status());
  absl::Time previous_time = absl::Now();
  for (uint64_t i = 0; iterations == 0 || i < iterations; ++i) {
    absl::SleepFor(absl::Seconds(interval));
    absl::StatusOr<dynamiq::v1::GetStatusResponse> current = client.GetStatus();
    if (!current.ok()) return Failure(err, current.status());
    const absl::Time now = absl::Now();
    const std::vector<TopRow> rows = TopRows(*previous, *current, absl::ToDoubleSeconds(now - previous_time));
    if (i > 0 && !in.terminal && !in.json) out << "\n";  // refreshes one after another in a log or pipe
    out << FormatTop(*current, rows, in.json, in.terminal && !in.json, now) << std::flush;
    previous = std::move(current);
    previous_time = now;
  }
  return kExitOk;
}

}  // namespace

int Run(const Invocation& in, std::ostream& out, std::ostream& err) {
  if (in.args.empty()) {
    return UsageError(err, "no command given (status, set-compression, flight-recorder, health or top)");
  }
  if (in.args.size() > 1) return UsageError(err, absl::StrCat("unexpected argument '", in.args[1], "'"));
  const std::string& command = in.args[0];
  const auto& commands = Commands();
  auto info = std::find_if(commands.begin(), commands.end(), [&](const CommandInfo& c) { return c.name == command; });
  if (info == commands.end()) {
    return UsageError(
        err, absl::StrCat("unknown command '", command, "' (status, set-compression, flight-recorder, health or top)"));
  }
  for (const std::string& flag : GivenCommandFlags(in)) {
    if (std::find(info->flags.begin(), info->flags.end(), flag) != info->flags.end()) continue;
    std::vector<std::string> takers;
    for (const CommandInfo& c : commands) {
      if (std::find(c.flags.begin(), c.flags.end(), flag) != c.flags.end()) takers.push_back(c.name);
    }
    return UsageError(err, absl::StrCat("--", flag, " does not apply to '", command, "' (it is for ",
                                        absl::StrJoin(takers, ", "), ")"));
  }
  if (in.connect.daemon.empty()) return UsageError(err, "--daemon must name the daemon's host:port");
  if (in.connect.timeout <= absl::ZeroDuration()) return UsageError(err, "--timeout must be positive");

  const ControlClient client(in.connect);
  if (command == "top") return RunTop(client, in, out, err);
  if (command == "status") {
    absl::StatusOr<dynamiq::v1::GetStatusResponse> status = client.GetStatus();
    if (!status.ok()) return Failure(err, status.status());
    out << FormatStatus(*status, in.json);
    return kExitOk;
  }
  if (command == "set-compression") {
    if (!in.job || in.job->empty()) return UsageError(err, "set-compression needs --job");
    if (in.compression.codec && in.compression.bits) {
      // --bits on a codec without a bit setting would be shown (int8/3.7) but never used.
      absl::StatusOr<kernels::CodecId> id = kernels::ParseCodecId(*in.compression.codec);
      if (id.ok()) {
        if (absl::Status s = kernels::CheckBitsSetting(*id, *in.compression.bits); !s.ok()) {
          return UsageError(err, absl::StrCat("--bits: ", s.message()));
        }
      }
    }
    CompressionChange change = in.compression;
    change.job_id = *in.job;
    absl::StatusOr<CompressionChangeResult> result = ChangeCompression(client, change);
    if (!result.ok()) return Failure(err, result.status());
    out << FormatCompressionChange(*result, in.json);
    return kExitOk;
  }
  if (command == "flight-recorder") {
    absl::StatusOr<dynamiq::v1::GetFlightRecorderResponse> records =
        client.GetFlightRecorder(in.job.value_or(""), in.limit.value_or(0));
    if (!records.ok()) return Failure(err, records.status());
    out << FormatFlightRecorder(*records, in.json);
    return kExitOk;
  }
  // health
  const std::string service = in.service.value_or("");
  absl::StatusOr<HealthCheckResponse::ServingStatus> health = client.CheckHealth(service);
  if (!health.ok()) return Failure(err, health.status());
  out << FormatHealth(service, *health, in.json);
  return *health == HealthCheckResponse::SERVING ? kExitOk : kExitFailure;
}

}  // namespace dynamiq::ctl
