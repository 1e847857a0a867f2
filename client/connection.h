// Internals of the client library (not installed): the gRPC connection shared by a Client and its
// Buffers, the state behind a Future, and the gRPC -> absl::Status mapping.
//
// Lifetimes: a Client and every Buffer it allocated hold the Connection (shared_ptr), so a Buffer
// can still release itself after its Client is gone. In-flight asynchronous calls hold only their
// own CallState, the FutureState and the OpTracker, never the Connection: the Connection (and the
// gRPC channel) is therefore always destroyed on a user thread, never inside a gRPC callback, and
// ~Client waits on the OpTracker until no call is in flight before it lets go of the channel.
#ifndef DQ_CLIENT_CONNECTION_H_
#define DQ_CLIENT_CONNECTION_H_

#include <grpcpp/grpcpp.h>

#include <stdint.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/cuda_ipc.h"
#include "client/ring_submitter.h"
#include "dynamiq/client.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "ipc/shm_region.h"

namespace dynamiq::client::internal {

// Calls made from destructors (ReleaseBuffer from ~Buffer, Unregister from ~Client) wait at most
// this long, or ClientOptions::timeout if that is shorter: a hung daemon must not hang teardown.
inline constexpr absl::Duration kTeardownTimeout = absl::Seconds(5);

// The fields of an AllReduceResponse.
inline AllReduceResult ToResult(const dynamiq::v1::AllReduceResponse& response) {
  AllReduceResult r;
  r.sequence = response.sequence();
  r.config_epoch = response.config_epoch();
  r.codec = response.codec();
  r.bits = response.bits();
  r.wire_bytes = response.wire_bytes();
  if (response.has_measured_vnmse()) r.measured_vnmse = response.measured_vnmse();
  r.contributors = response.contributors();
  r.nodes.assign(response.nodes().begin(), response.nodes().end());
  r.weight_sum = response.weight_sum();
  return r;
}

// grpc::Status -> absl::Status. Codes the daemon produces (INVALID_ARGUMENT, NOT_FOUND, ...) keep
// code and message unchanged. UNAVAILABLE and DEADLINE_EXCEEDED, which gRPC itself produces when the
// socket is missing or the deadline passes, keep their code and get "<rpc> to dynamiqd at
// <socket>[ (deadline <timeout>)]: " in front of the message, so the error says where and how long.
// A DEADLINE_EXCEEDED that arrives before the call's own `deadline` is the daemon's answer (its
// --timeout fired; its message names what it waited for); at or after it, the client's own deadline.
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view rpc, absl::string_view socket_path,
                            absl::Duration timeout, absl::Time deadline);
// The same for a status the daemon answered through the submission ring.
absl::Status FromDaemonStatus(const absl::Status& status, absl::string_view rpc, absl::string_view socket_path,
                              absl::Duration timeout, absl::Time deadline);

// Counts a connection's in-flight asynchronous calls so that ~Client can wait for them.
// Thread-safe.
class OpTracker {
 public:
  void Start() {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  void Done() {
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }
  void WaitIdle() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int64_t* n) { return *n == 0; }, &in_flight_));
  }

 private:
  absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

// The completion of one asynchronous call. Thread-safe.
class FutureState {
 public:
  void Complete(absl::Status status, AllReduceResult result = {}) {
    absl::MutexLock lock(&mu_);
    status_ = std::move(status);
    result_ = std::move(result);
    done_ = true;
  }
  absl::Status Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return status_;
  }
  bool Ready() {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  // Complete() writes it once; callers read it after Wait(), so the reference stays valid.
  const AllReduceResult& result() {
    absl::MutexLock lock(&mu_);
    return result_;
  }

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  AllReduceResult result_ ABSL_GUARDED_BY(mu_);
};

// One registration with the daemon. Immutable after Client::Connect() filled it in, except for the
// stub (thread-safe) and the tracker (thread-safe): safe to share between threads.
class Connection {
 public:
  Connection(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
      : options_(std::move(options)),
        channel_(std::move(channel)),
        stub_(dynamiq::v1::Worker::NewStub(channel_)),
        tracker_(std::make_shared<OpTracker>()) {}

  const ClientOptions& options() const { return options_; }
  dynamiq::v1::Worker::Stub& stub() const { return *stub_; }
  const std::shared_ptr<OpTracker>& tracker() const { return tracker_; }

  // Sets the deadline of a call: now + `timeout`.
  static void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  // `context`: the call's (for its deadline).
  absl::Status FromGrpc(const grpc::Status& status, absl::string_view rpc, absl::Duration timeout,
                        const grpc::ClientContext& context) const {
    return FromGrpcStatus(status, rpc, options_.socket_path, timeout, absl::FromChrono(context.deadline()));
  }

  // ReleaseBuffer with the given deadline. After Unregister() it does not call the daemon (which
  // frees a worker's buffers when it unregisters) and returns OK.
  absl::Status ReleaseBuffer(uint64_t buffer_id, absl::Duration timeout) const;
  // Unregister with the given deadline; at most once (later calls return OK).
  absl::Status Unregister(absl::Duration timeout);

  // Filled in by Client::Connect() from the RegisterResponse.
  std::string worker_id;
  // Numbers this worker's all-reduces in the order they are issued (AllReduceRequest.submission), so
  // asynchronous requests that reach the daemon out of order still land in the right collective.
  std::atomic<uint64_t> next_submission{0};
  uint32_t node_rank = 0;
  uint32_t num_nodes = 0;
  uint64_t config_epoch = 0;
  CompressionConfig config;
  DeviceKind daemon_device = DeviceKind::kCpu;
  // The submission ring (client/ring_submitter.h), when the daemon offered one; else null.
  std::unique_ptr<RingSubmitter> ring;

 private:
  const ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<dynamiq::v1::Worker::Stub> stub_;
  const std::shared_ptr<OpTracker> tracker_;
  std::atomic<bool> unregistered_{false};
};

// What a Buffer owns: the mapping (shared memory, or a device buffer's CUDA IPC mapping) and its
// registration.
struct BufferImpl {
  std::shared_ptr<Connection> connection;
  // All-reduces on the buffer that have not returned yet: releasing the buffer waits for them (each
  // has a deadline), so the daemon never sees a release racing an all-reduce of the same buffer.
  std::shared_ptr<OpTracker> uses = std::make_shared<OpTracker>();
  ipc::ShmRegion region;
  CudaIpcMapping device_mapping;
  uint64_t id = 0;
  size_t size = 0;
};

}  // namespace dynamiq::client::internal

#endif  // DQ_CLIENT_CONNECTION_H_
