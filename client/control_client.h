// ControlClient: dynamiqd's operator API for programs: dynamiq.v1.Control and grpc.health.v1 calls,
// each with a deadline, failures as absl::Status carrying the daemon's gRPC code and a hint at the
// usual mistake (no TLS CA, the worker socket given as the daemon, a timeout). dynamiqctl and the
// Python module (dynamiq.Control) both link it. ChangeCompression sends a partial compression change
// (only the fields given; the daemon merges it into the job's newest configuration).
//
// Thread-safety: ControlClient is thread-safe (gRPC stubs are); the free functions are pure.
#ifndef DQ_CLIENT_CONTROL_CLIENT_H_
#define DQ_CLIENT_CONTROL_CLIENT_H_

#include <stdint.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "dynamiq/v1/control.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace dynamiq::ctl {

struct ConnectOptions {
  // The daemon's --listen address (host:port; any gRPC target name works).
  std::string daemon = "127.0.0.1:7070";
  // Deadline of every RPC, counted from its start.
  absl::Duration timeout = absl::Seconds(10);
  // Operator bearer token (dynamiqd --operator_token_file), sent on every call as
  // "authorization: Bearer <token>"; empty: none.
  std::string token;
  // PEM CA certificates: when set, the channel uses TLS and verifies the daemon's certificate
  // (dynamiqd --tls_cert) against them; empty: plaintext.
  std::string tls_ca_pem;
};

// Fills `options`' token from `token_file` (its first token; the file must be owner-only, as for
// dynamiqd, see common/secret_file.h) and its CA from `tls_ca_file`; an empty path leaves the field
// alone. Errors name the setting (`token_file_name`, `tls_ca_name`: dynamiqctl's flags by default;
// the Python API passes its argument names), the path and the fix.
absl::Status LoadCredentials(const std::string& token_file, const std::string& tls_ca_file, ConnectOptions& options,
                             absl::string_view token_file_name = "--token_file",
                             absl::string_view tls_ca_name = "--tls_ca");

// Calls dynamiqd's operator API. A failed call returns an absl::Status with the RPC's code and
// message; transport failures (UNAVAILABLE, DEADLINE_EXCEEDED) also name the daemon address.
class ControlClient {
 public:
  explicit ControlClient(ConnectOptions options);

  absl::StatusOr<dynamiq::v1::GetStatusResponse> GetStatus() const;
  // The epoch at which the change applies and the job's complete configuration from then on.
  absl::StatusOr<dynamiq::v1::SetCompressionResponse> SetCompression(
      const dynamiq::v1::SetCompressionRequest& request) const;
  absl::StatusOr<dynamiq::v1::GetFlightRecorderResponse> GetFlightRecorder(const std::string& job_id,
                                                                           uint32_t limit) const;
  // grpc.health.v1.Health/Check; `service` empty asks about the whole server. An unknown service is
  // NOT_FOUND (the daemon's answer), not a status.
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(const std::string& service) const;

  const ConnectOptions& options() const { return options_; }

 private:
  absl::Status FromGrpc(const grpc::Status& status) const;
  // Deadline and token.
  void Prepare(grpc::ClientContext& context) const;

  const ConnectOptions options_;
  std::unique_ptr<dynamiq::v1::Control::Stub> control_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// set-compression: only the fields given are sent; the daemon merges them into the job's newest
// configuration (staged or applied) as it claims the next epoch (server/job_config.h,
// ApplyCompressionChange), so nothing is read first and no concurrent or staged change is undone.
// A new codec without bits gets that codec's default bits (dynamiq 5, others 4), since bits mean
// different things per codec.
struct CompressionChange {
  std::string job_id;
  std::optional<std::string> codec;
  std::optional<double> bits;
  std::optional<std::string> topology;
  std::optional<uint64_t> min_compress_elements;
  std::optional<std::string> allocator;
  // Error budget (docs/error_budget.md). target_vnmse > 0 puts the job under a budget (codec dynamiq,
  // chosen when the job uses another and --codec is not given; bits, when given, is where the
  // controller starts); 0 returns it to fixed bits. --bits alone also returns it to fixed bits.
  // min_bits / max_bits / sample_rate change the current budget's fields (INVALID_ARGUMENT without
  // one or a new target); unset ones keep the current budget's values (defaults 3, 8, 0).
  std::optional<double> target_vnmse;
  std::optional<double> min_bits;
  std::optional<double> max_bits;
  std::optional<double> sample_rate;
  // The loss-tolerant all-reduce's phase in milliseconds (0: reliable; needs dynamiqd --transport=udp).
  std::optional<double> lossy_phase_ms;
  // Fail with ABORTED unless the job's newest epoch (staged or applied) is this one.
  std::optional<uint64_t> expected_epoch;
};

struct CompressionChangeResult {
  std::string job_id;
  uint64_t epoch = 0;                     // the epoch at which `config` applies on every node
  dynamiq::v1::CompressionConfig config;  // the job's complete configuration from `epoch` on
};

absl::StatusOr<CompressionChangeResult> ChangeCompression(const ControlClient& client, const CompressionChange& change);

}  // namespace dynamiq::ctl

#endif  // DQ_CLIENT_CONTROL_CLIENT_H_
