// dynamiqctl's logic, kept out of main.cc so tests can drive it against an in-process daemon: the
// human-readable tables and JSON lines each command prints, and Run(), which validates an
// Invocation, runs its command through a ControlClient (client/control_client.h) and returns the
// process exit code.
//
// Output contract: tables are for people and may change; --json prints one JSON object per line in
// protobuf's canonical JSON mapping with the .proto field names (so uint64 fields such as
// config_epoch are strings), the stable interface for scripts.
//
// Thread-safety: the free functions are pure.
#ifndef DQ_TOOLS_DYNAMIQCTL_CTL_H_
#define DQ_TOOLS_DYNAMIQCTL_CTL_H_

#include <stdint.h>

#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/control_client.h"
#include "dynamiq/v1/control.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace dynamiq::ctl {

// Exit codes of dynamiqctl.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the daemon returned an error, or health is not SERVING
inline constexpr int kExitUsage = 2;    // bad command line

// What each command prints on success; `json`: one JSON object per line.
std::string FormatStatus(const dynamiq::v1::GetStatusResponse& status, bool json);
std::string FormatCompressionChange(const CompressionChangeResult& result, bool json);
// Tables oldest first as the daemon returns them, then the error-budget controller's events (on the
// coordinator node); JSON: one CollectiveRecord per line, then one ErrorBudgetEvent per line.
std::string FormatFlightRecorder(const dynamiq::v1::GetFlightRecorderResponse& records, bool json);
std::string FormatHealth(const std::string& service, grpc::health::v1::HealthCheckResponse::ServingStatus status,
                         bool json);

// `top`: one job's activity between two GetStatus answers `seconds` apart. Rates follow the metric
// definitions (docs/metrics.md): algbw and busbw divide bytes by the time spent in collectives
// (nccl-tests), wire bandwidth and collectives/s by wall-clock time, the compression ratio is bus
// bytes over wire bytes. A job missing from `previous`, or whose counters went backwards (daemon
// restarted), counts from zero.
struct TopRow {
  std::string job_id;
  std::string codec;
  double bits = 0;
  uint64_t config_epoch = 0;
  uint32_t workers = 0;
  uint32_t inflight = 0;
  double seconds = 0;        // the interval
  uint64_t collectives = 0;  // succeeded in the interval
  uint64_t failed = 0;       // failed in the interval
  double collectives_per_second = 0;
  std::optional<double> algbw;  // bytes/s; unset without collectives in the interval
  std::optional<double> busbw;  // bytes/s; unset without collectives or on one node
  double wire_bytes_per_second = 0;
  std::optional<double> compression_ratio;  // unset without wire bytes in the interval
  std::optional<double> last_vnmse;         // unset until an error sample exists
  uint64_t error_samples = 0;               // cumulative
  // The straggler view in the interval: the node (else, on one node or when no node waited, the
  // local rank) this node's collectives waited for longest, and for how long in all.
  std::string slowest;  // "node 1", "rank 3"; empty: nobody was waited for
  double slowest_wait_seconds = 0;
  // The loss-tolerant all-reduce in the interval: the fraction of the datagrams expected from other
  // nodes that did not arrive in time (unset: none expected), and the elements kept from this
  // node's values since the last resync.
  std::optional<double> loss;
  uint64_t drift_elements = 0;
};
std::vector<TopRow> TopRows(const dynamiq::v1::GetStatusResponse& previous,
                            const dynamiq::v1::GetStatusResponse& current, double seconds);
// One refresh: a header line and a table (or "no jobs"); JSON: one object per job per line.
// `terminal`: start with the escape sequence that clears the screen (tables only).
std::string FormatTop(const dynamiq::v1::GetStatusResponse& status, const std::vector<TopRow>& rows, bool json,
                      bool terminal, absl::Time now);
// "NOT_FOUND: no job 'x' on this node": the gRPC code name, then the message.
std::string FormatError(const absl::Status& status);

// One dynamiqctl command line after flag parsing. Command flags are optional: unset means "not
// given", and giving one to a command that does not take it is a usage error.
struct Invocation {
  std::vector<std::string> args;  // positional arguments: exactly one, the command
  ConnectOptions connect;
  bool json = false;
  std::optional<std::string> job;
  // set-compression's flags (its job_id comes from `job`).
  CompressionChange compression;
  std::optional<uint32_t> limit;
  std::optional<std::string> service;
  std::optional<double> interval;      // top: seconds between refreshes (default 1)
  std::optional<uint64_t> iterations;  // top: refreshes before exiting (default 0: until interrupted)
  bool terminal = false;               // stdout is a terminal: top redraws in place
};

// The commands, what they do and the command flags each takes (for validation and --help).
struct CommandInfo {
  std::string name;
  std::string summary;
  std::vector<std::string> flags;  // flag names without "--"
};
const std::vector<CommandInfo>& Commands();

// Runs the command: its output on `out`, errors on `err` ("dynamiqctl: CODE: message"); returns
// kExitOk, kExitFailure (RPC error; health not SERVING) or kExitUsage.
int Run(const Invocation& invocation, std::ostream& out, std::ostream& err);

}  // namespace dynamiq::ctl

#endif  // DQ_TOOLS_DYNAMIQCTL_CTL_H_
