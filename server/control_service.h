// ControlService: dynamiq.v1.Control, the operator API (TCP): status, runtime compression changes,
// the flight recorder. Invalid values get INVALID_ARGUMENT, an unknown job NOT_FOUND, a stale
// expected epoch ABORTED.
#ifndef DQ_SERVER_CONTROL_SERVICE_H_
#define DQ_SERVER_CONTROL_SERVICE_H_

#include "dynamiq/v1/control.grpc.pb.h"
#include "server/daemon.h"

namespace dynamiq::server {

class ControlService final : public dynamiq::v1::Control::Service {
 public:
  explicit ControlService(Daemon& daemon) : daemon_(daemon) {}

  grpc::Status GetStatus(grpc::ServerContext*, const dynamiq::v1::GetStatusRequest*,
                         dynamiq::v1::GetStatusResponse*) override;
  grpc::Status SetCompression(grpc::ServerContext*, const dynamiq::v1::SetCompressionRequest*,
                              dynamiq::v1::SetCompressionResponse*) override;
  grpc::Status GetFlightRecorder(grpc::ServerContext*, const dynamiq::v1::GetFlightRecorderRequest*,
                                 dynamiq::v1::GetFlightRecorderResponse*) override;

 private:
  Daemon& daemon_;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_CONTROL_SERVICE_H_
