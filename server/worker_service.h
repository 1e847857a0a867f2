// WorkerService: dynamiq.v1.Worker, the gRPC face of Daemon's worker API (Unix socket).
// Translates messages and statuses; all logic lives in Daemon. AllReduce is a callback method: it
// queues the request (Daemon::AllReduceAsync) and answers when the collective completes, so no
// thread waits per outstanding all-reduce; the other methods are quick and synchronous. All-reduces
// through a worker's submission ring (OpenSubmissionRing) bypass gRPC: server/worker_rings.h.
#ifndef DQ_SERVER_WORKER_SERVICE_H_
#define DQ_SERVER_WORKER_SERVICE_H_

#include "dynamiq/v1/worker.grpc.pb.h"
#include "server/daemon.h"

namespace dynamiq::server {

class WorkerService final : public dynamiq::v1::Worker::WithCallbackMethod_AllReduce<dynamiq::v1::Worker::Service> {
 public:
  explicit WorkerService(Daemon& daemon) : daemon_(daemon) {}

  grpc::Status Register(grpc::ServerContext*, const dynamiq::v1::RegisterRequest*,
                        dynamiq::v1::RegisterResponse*) override;
  grpc::Status AllocateBuffer(grpc::ServerContext*, const dynamiq::v1::AllocateBufferRequest*,
                              dynamiq::v1::AllocateBufferResponse*) override;
  grpc::Status Mapped(grpc::ServerContext*, const dynamiq::v1::MappedRequest*, dynamiq::v1::MappedResponse*) override;
  grpc::Status ReleaseBuffer(grpc::ServerContext*, const dynamiq::v1::ReleaseBufferRequest*,
                             dynamiq::v1::ReleaseBufferResponse*) override;
  grpc::ServerUnaryReactor* AllReduce(grpc::CallbackServerContext*, const dynamiq::v1::AllReduceRequest*,
                                      dynamiq::v1::AllReduceResponse*) override;
  grpc::Status Unregister(grpc::ServerContext*, const dynamiq::v1::UnregisterRequest*,
                          dynamiq::v1::UnregisterResponse*) override;
  grpc::Status OpenSubmissionRing(grpc::ServerContext*, const dynamiq::v1::OpenSubmissionRingRequest*,
                                  dynamiq::v1::OpenSubmissionRingResponse*) override;

 private:
  // The worker a call names (its worker_id field), if the call comes from that worker's process
  // (Daemon::CheckCaller).
  absl::StatusOr<uint64_t> Caller(const grpc::ServerContextBase& context, absl::string_view worker_id);

  Daemon& daemon_;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_WORKER_SERVICE_H_
