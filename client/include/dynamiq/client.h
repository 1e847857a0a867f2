// The dynamiq client library: how a worker process (a training rank) hands gradients to its node's
// dynamiqd and gets the all-reduced sum back.
//
//   dynamiq::ClientOptions options;  // from DQ_SOCKET, DQ_JOB, DQ_LOCAL_RANK, ... (see options.h)
//   absl::StatusOr<dynamiq::Client> client = dynamiq::Client::Connect(options);
//   absl::StatusOr<dynamiq::Buffer> buffer = client->Allocate(n * sizeof(float));
//   float* grads = static_cast<float*>(buffer->data());
//   ... write the gradients ...
//   absl::Status s = client->AllReduce(*buffer, 0, n, dynamiq::DType::kFloat32, "layer1.weight");
//   ... grads now holds the sum over every worker of the job on every node ...
//
// Every worker of a job must submit the same tensors (name, element count, dtype) in the same
// order; the daemon fails a mismatch on every participant with a message naming who sent what.
// Asynchronous all-reduces (AllReduceAsync) may be outstanding concurrently, as DDP overlaps
// gradient buckets with the backward pass; the daemon matches them by name and order.
//
// The daemon side is dynamiqd's dynamiq.v1.Worker gRPC service (proto/dynamiq/v1/worker.proto)
// on a Unix socket; buffers are POSIX shared memory the daemon creates and unlinks once both
// sides mapped them, or on GPU nodes device memory shared through CUDA IPC handles. All-reduces
// travel through the worker's submission ring in shared memory (a futex doorbell each way) when the
// daemon offers one, else one gRPC call each (ClientOptions::submission_ring). Errors are absl::Status values: the
// daemon's code and message unchanged, or for UNAVAILABLE and DEADLINE_EXCEEDED the gRPC message prefixed with the call
// and the socket.
//
// Thread-safety: a Client's methods (other than moves and destruction) may be called concurrently
// from any threads. See buffer.h and future.h for Buffer and Future.
#ifndef DQ_CLIENT_INCLUDE_DYNAMIQ_CLIENT_H_
#define DQ_CLIENT_INCLUDE_DYNAMIQ_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dynamiq/buffer.h"
#include "dynamiq/future.h"
#include "dynamiq/options.h"

namespace dynamiq {

namespace client::internal {
class Connection;
}  // namespace client::internal

/// One worker's registration with its node's dynamiqd. Move-only.
class Client {
 public:
  /// Connects to dynamiqd at options.socket_path and registers the worker (job id, local rank,
  /// local world size). Fails with INVALID_ARGUMENT for bad options (or an unusable DQ_*
  /// variable), UNAVAILABLE naming the socket path if no daemon listens there, or the daemon's
  /// error (e.g. PERMISSION_DENIED for a socket of another user).
  static absl::StatusOr<Client> Connect(const ClientOptions& options = ClientOptions());

  Client(Client&& other) noexcept;
  Client& operator=(Client&& other) noexcept;
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  /// Waits for the client's outstanding asynchronous all-reduces (each ends by its deadline), then
  /// unregisters from the daemon (best effort, at most 5 seconds). Destroy the Client's Buffers
  /// first: releasing them afterwards still unmaps them, but the daemon may already have freed them.
  ~Client();

  /// Allocates a buffer of at least `bytes` bytes (positive) in the daemon.
  ///
  /// MemoryKind::kHost: a shared-memory buffer, mapped into this process (Buffer::data()) and the
  /// mapping confirmed (after which the daemon unlinks its name, so nothing is left in /dev/shm if
  /// either process dies).
  ///
  /// MemoryKind::kCudaDevice (a GPU node: dynamiqd --device=cuda): zeroed memory on the daemon's
  /// CUDA device, opened here with cudaIpcOpenMemHandle on the same device (found by its UUID,
  /// whatever this process's CUDA_VISIBLE_DEVICES) and exposed as Buffer::device_data(). The memory
  /// stays the daemon's: it is freed when the buffer is released (after this process closed its
  /// mapping), when the worker unregisters or exits, or when the daemon stops. Fails with
  /// UNIMPLEMENTED if this library was built without CUDA, FAILED_PRECONDITION if the daemon runs
  /// with --device=cpu or its device is not visible to this process, RESOURCE_EXHAUSTED when the
  /// device is out of memory. The worker must be a separate process from the daemon.
  /// Ordering: AllReduce() and AllReduceAsync() of a device buffer first wait until every write this
  /// process issued on that device has completed (cudaDeviceSynchronize), since the daemon reads the
  /// buffer as soon as the request arrives; results are in the buffer when the call returns (or the
  /// Future is ready), with no further synchronization needed.
  absl::StatusOr<Buffer> Allocate(size_t bytes, MemoryKind kind = MemoryKind::kHost);

  /// All-reduces `num_elements` elements of `dtype` starting `offset_bytes` into `buffer`, in place:
  /// returns once the sum over all workers of the job (divided by their number if `average`) is in
  /// the region, or with an error. `tensor_name` identifies the collective across workers and
  /// nodes. Bad arguments (empty buffer, a buffer of another Client, empty region or one that does
  /// not fit in the buffer, an offset not aligned to the element size, unknown dtype, empty name)
  /// fail with INVALID_ARGUMENT without contacting the daemon. On success, `result` (if not null)
  /// receives what the daemon reported about the collective.
  absl::Status AllReduce(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                         absl::string_view tensor_name, bool average = false, AllReduceResult* result = nullptr);

  /// Like AllReduce(), but submits the all-reduce and returns at once; the Future completes with
  /// the status AllReduce() would have returned. Several may be outstanding; leave the region (and
  /// the Buffer) alone until the Future is ready. Argument errors complete the Future immediately.
  Future AllReduceAsync(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                        absl::string_view tensor_name, bool average = false);

  /// The same two with AllReduceOptions: a weight (contribution accounting) besides `average`.
  /// A weight that is negative or not finite fails with INVALID_ARGUMENT without contacting the daemon.
  absl::Status AllReduce(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                         absl::string_view tensor_name, const AllReduceOptions& options,
                         AllReduceResult* result = nullptr);
  Future AllReduceAsync(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                        absl::string_view tensor_name, const AllReduceOptions& options);

  // The accessors below must not be called on a moved-from Client.

  /// The daemon's id of this registration.
  const std::string& worker_id() const;
  /// This node's rank in the cluster and the number of nodes, as the daemon reported at Register.
  uint32_t node_rank() const;
  uint32_t num_nodes() const;
  /// The job's compression config epoch and config at registration. They may change at runtime
  /// (dynamiqctl set-compression); the daemon applies a change on every worker at the same
  /// collective boundary, so workers need not track it.
  uint64_t config_epoch() const;
  const CompressionConfig& config() const;
  /// Where the daemon reduces (--device): kCuda daemons also hand out device buffers.
  DeviceKind daemon_device() const;
  /// True when all-reduces go through the submission ring in shared memory
  /// (ClientOptions::submission_ring, and the daemon offered one).
  bool uses_submission_ring() const;
  /// The options the client connected with.
  const ClientOptions& options() const;

 private:
  explicit Client(std::shared_ptr<client::internal::Connection> connection);
  // Allocate(bytes, MemoryKind::kCudaDevice).
  absl::StatusOr<Buffer> AllocateDevice(size_t bytes);
  // The client-side argument checks of AllReduce() and AllReduceAsync().
  absl::Status CheckAllReduce(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                              absl::string_view tensor_name, const AllReduceOptions& options) const;

  std::shared_ptr<client::internal::Connection> connection_;
};

}  // namespace dynamiq

#endif  // DQ_CLIENT_INCLUDE_DYNAMIQ_CLIENT_H_
