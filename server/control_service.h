// ControlService: dynamiq.v1.Control, the operator API (TCP): status, runtime compression changes,
// the flight recorder. Invalid values get INVALID_ARGUMENT, an unknown job NOT_FOUND, a stale
// expected epoch ABORTED. With an operator authenticator (--operator_token_file) every handler
// first checks the call's bearer token: UNAUTHENTICATED, counted as a rejected request, otherwise.
// Every new handler must start with Authorize() (tests/server/security_test.cc calls every method
// of the service without a token).
#ifndef DQ_SERVER_CONTROL_SERVICE_H_
#define DQ_SERVER_CONTROL_SERVICE_H_

#include "dynamiq/v1/control.grpc.pb.h"
#include "server/bearer_auth.h"
#include "server/daemon.h"

namespace dynamiq::server {

class ControlService final : public dynamiq::v1::Control::Service {
 public:
  // `auth` (null: open) must outlive the service.
  explicit ControlService(Daemon& daemon, const BearerAuthenticator* auth = nullptr) : daemon_(daemon), auth_(auth) {}

  grpc::Status GetStatus(grpc::ServerContext* context, const dynamiq::v1::GetStatusRequest*,
                         dynamiq::v1::GetStatusResponse*) override;
  grpc::Status SetCompression(grpc::ServerContext*, const dynamiq::v1::SetCompressionRequest*,
                              dynamiq::v1::SetCompressionResponse*) override;
  grpc::Status GetFlightRecorder(grpc::ServerContext*, const dynamiq::v1::GetFlightRecorderRequest*,
                                 dynamiq::v1::GetFlightRecorderResponse*) override;

 private:
  // OK, or the refusal of an unauthenticated call (recorded as rejected).
  grpc::Status Authorize(const grpc::ServerContext& context);

  Daemon& daemon_;
  const BearerAuthenticator* const auth_;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_CONTROL_SERVICE_H_
