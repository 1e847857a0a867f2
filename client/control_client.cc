#include "client/control_client.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/secret_file.h"
#include "common/status_macros.h"

namespace dynamiq::ctl {
namespace {

// What grpc::BlockingUnaryCall reports when the server's reply did not deserialize.
constexpr absl::string_view kNoReplyDecoded = "No message returned for unary request";

using dynamiq::v1::CompressionConfig;
using grpc::health::v1::HealthCheckResponse;

std::chrono::system_clock::time_point Deadline(absl::Duration timeout) {
  return absl::ToChronoTime(absl::Now() + timeout);
}

}  // namespace

absl::Status LoadCredentials(const std::string& token_file, const std::string& tls_ca_file, ConnectOptions& options,
                             absl::string_view token_file_name, absl::string_view tls_ca_name) {
  if (!token_file.empty()) {
    absl::StatusOr<std::vector<std::string>> tokens = common::ReadTokens(token_file, token_file_name);
    if (!tokens.ok()) return tokens.status();
    options.token = tokens->front();
  }
  if (!tls_ca_file.empty()) {
    absl::StatusOr<std::string> ca = common::ReadPublicFile(tls_ca_file, tls_ca_name);
    if (!ca.ok()) return ca.status();
    if (ca->find("-----BEGIN CERTIFICATE-----") == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(tls_ca_name, ": ", tls_ca_file, " holds no PEM certificate"));
    }
    options.tls_ca_pem = *std::move(ca);
  }
  return absl::OkStatus();
}

ControlClient::ControlClient(ConnectOptions options) : options_(std::move(options)) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options_.tls_ca_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.tls_ca_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(options_.daemon, credentials);
  control_ = dynamiq::v1::Control::NewStub(channel);
  health_ = grpc::health::v1::Health::NewStub(channel);
}

void ControlClient::Prepare(grpc::ClientContext& context) const {
  context.set_deadline(Deadline(options_.timeout));
  if (!options_.token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.token));
}

absl::Status ControlClient::FromGrpc(const grpc::Status& status) const {
  if (status.ok()) return absl::OkStatus();
  std::string message = status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    absl::StrAppend(&message, " (dynamiqd at ", options_.daemon,
                    options_.tls_ca_pem.empty() ? "; if it runs with --tls_cert, give its CA with --tls_ca"
                                                : "; TLS: does --tls_ca verify its certificate?",
                    ")");
  } else if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED && message == kNoReplyDecoded) {
    // gRPC's blocking unary call says so when the reply arrived but did not parse.
    return absl::InternalError(absl::StrCat("the reply of dynamiqd at ", options_.daemon,
                                            " could not be decoded (a dynamiqd of another version, or a reply that "
                                            "is not valid protobuf)"));
  } else if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    // Something answers gRPC there, but not dynamiq.v1.Control: the worker socket, say.
    absl::StrAppend(&message, message.empty() ? "" : " ", "(", options_.daemon,
                    " does not serve dynamiq.v1.Control: --daemon is dynamiqd's --listen address, host:port, not its "
                    "worker socket)");
  } else if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    absl::StrAppend(&message, " (dynamiqd at ", options_.daemon, " did not answer within ",
                    absl::FormatDuration(options_.timeout), "; see --timeout)");
  }
  // grpc::StatusCode and absl::StatusCode share their values (both are the canonical gRPC codes).
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), message);
}

absl::StatusOr<dynamiq::v1::GetStatusResponse> ControlClient::GetStatus() const {
  grpc::ClientContext context;
  Prepare(context);
  dynamiq::v1::GetStatusResponse response;
  grpc::Status status = control_->GetStatus(&context, dynamiq::v1::GetStatusRequest(), &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

absl::StatusOr<dynamiq::v1::SetCompressionResponse> ControlClient::SetCompression(
    const dynamiq::v1::SetCompressionRequest& request) const {
  grpc::ClientContext context;
  Prepare(context);
  dynamiq::v1::SetCompressionResponse response;
  grpc::Status status = control_->SetCompression(&context, request, &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

absl::StatusOr<dynamiq::v1::GetFlightRecorderResponse> ControlClient::GetFlightRecorder(const std::string& job_id,
                                                                                        uint32_t limit) const {
  grpc::ClientContext context;
  Prepare(context);
  dynamiq::v1::GetFlightRecorderRequest request;
  request.set_job_id(job_id);
  request.set_limit(limit);
  dynamiq::v1::GetFlightRecorderResponse response;
  grpc::Status status = control_->GetFlightRecorder(&context, request, &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

absl::StatusOr<HealthCheckResponse::ServingStatus> ControlClient::CheckHealth(const std::string& service) const {
  grpc::ClientContext context;
  Prepare(context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  grpc::Status status = health_->Check(&context, request, &response);
  if (!status.ok()) return FromGrpc(status);
  return response.status();
}

absl::StatusOr<CompressionChangeResult> ChangeCompression(const ControlClient& client,
                                                          const CompressionChange& change) {
  if (change.job_id.empty()) return absl::InvalidArgumentError("set-compression needs --job");
  const bool budget_fields = change.min_bits || change.max_bits || change.sample_rate;
  if (change.target_vnmse && *change.target_vnmse == 0 && budget_fields) {
    return absl::InvalidArgumentError("--target_vnmse=0 (fixed bits) takes no --min_bits, --max_bits or --sample_rate");
  }
  // Only what was given: the daemon merges it into the job's newest configuration.
  dynamiq::v1::SetCompressionRequest request;
  request.set_job_id(change.job_id);
  CompressionConfig* config = request.mutable_config();
  if (change.codec) config->set_codec(*change.codec);
  if (change.bits) config->set_bits(*change.bits);
  if (change.topology) config->set_topology(*change.topology);
  if (change.min_compress_elements) config->set_min_compress_elements(*change.min_compress_elements);
  if (change.allocator) config->set_allocator(*change.allocator);
  if (change.lossy_phase_ms) config->set_lossy_phase_ms(*change.lossy_phase_ms);
  if (change.target_vnmse || budget_fields) {
    dynamiq::v1::ErrorBudget* budget = config->mutable_error_budget();
    if (change.target_vnmse) budget->set_target_vnmse(*change.target_vnmse);
    if (change.min_bits) budget->set_min_bits(*change.min_bits);
    if (change.max_bits) budget->set_max_bits(*change.max_bits);
    if (change.sample_rate) budget->set_sample_rate(*change.sample_rate);
  }
  if (change.expected_epoch) request.set_expected_epoch(*change.expected_epoch);
  absl::StatusOr<dynamiq::v1::SetCompressionResponse> response = client.SetCompression(request);
  if (!response.ok()) {
    if (absl::IsNotFound(response.status())) {
      return common::Restate(response.status(),
                             absl::StrCat(response.status().message(), " (dynamiqd at ", client.options().daemon, ")"));
    }
    return response.status();
  }
  CompressionChangeResult result;
  result.job_id = change.job_id;
  result.epoch = response->epoch();
  result.config = response->config();
  return result;
}

}  // namespace dynamiq::ctl
