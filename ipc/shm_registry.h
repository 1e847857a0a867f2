// ShmRegistry: the daemon's table of shared-memory buffers (ipc/shm_region.h) handed out to
// local worker processes, keyed by (worker id, buffer id). The daemon allocates a buffer when a
// worker asks for one, sends it the ShmBufferInfo, unlinks the name once the worker has mapped it,
// resolves the (buffer, offset, length) regions named by all-reduce requests with Use(), and frees
// everything a worker had when it disconnects or dies (ReleaseWorker()).
//
// Limits: a per-worker and a global byte limit, and a per-worker buffer count limit (every buffer
// is one mapping; vm.max_map_count is finite). Allocations beyond them fail with
// RESOURCE_EXHAUSTED and change nothing. Buffer ids are unique for the registry's lifetime (never
// reused), so a stale id from a released buffer is NOT_FOUND rather than someone else's memory.
//
// The bookkeeping is ipc/worker_buffers.h, shared with the device registry.
//
// Thread-safety: every method is thread-safe (one absl::Mutex). Creating a region (which reserves
// its memory) and unmapping one run outside the lock, so a large allocation does not stall Use().
// A region returned by Use() stays mapped while the BufferUse lives: Release() refuses the buffer
// meanwhile and ReleaseWorker() unmaps it only when the use ends. The registry outlives the uses.
#ifndef DQ_IPC_SHM_REGISTRY_H_
#define DQ_IPC_SHM_REGISTRY_H_

#include <stddef.h>
#include <stdint.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "ipc/buffer_limits.h"
#include "ipc/shm_region.h"
#include "ipc/worker_buffers.h"

namespace dynamiq::ipc {

// What a worker needs to map a buffer: ShmRegion::Open(shm_name, size).
struct ShmBufferInfo {
  uint64_t buffer_id = 0;
  std::string shm_name;
  size_t size = 0;
};

class ShmRegistry {
 public:
  using Options = BufferLimits;

  ShmRegistry() : ShmRegistry(Options()) {}
  explicit ShmRegistry(Options options);
  // The destructor unmaps (and unlinks any still-linked name of) every buffer.

  // Creates a buffer of `bytes` bytes for `worker_id`. INVALID_ARGUMENT for a zero or oversized
  // request, RESOURCE_EXHAUSTED over a limit (or when /dev/shm is full), ABORTED if the worker was
  // released while the buffer was being created.
  absl::StatusOr<ShmBufferInfo> Allocate(uint64_t worker_id, size_t bytes);

  // The bytes [offset, offset + length) of a buffer of `worker_id`. NOT_FOUND if the worker has no
  // such buffer (including another worker's buffer id); OUT_OF_RANGE if the region does not lie
  // inside the buffer. A zero-length region at offset <= size is allowed (an empty span). The
  // buffer is in use until the result (and its copies) is gone.
  absl::StatusOr<BufferUse> Use(uint64_t worker_id, uint64_t buffer_id, size_t offset, size_t length);

  // Unlinks the buffer's shm name (call once the worker has mapped it); idempotent. NOT_FOUND for
  // an unknown buffer.
  absl::Status Unlink(uint64_t worker_id, uint64_t buffer_id);

  // Frees one buffer. NOT_FOUND for an unknown buffer, FAILED_PRECONDITION for one in use.
  absl::Status Release(uint64_t worker_id, uint64_t buffer_id);

  // Frees every buffer of `worker_id` (none is fine; one in use when its use ends) and returns how
  // many there were.
  size_t ReleaseWorker(uint64_t worker_id);

  // Bytes of all mapped buffers (for a shared-memory bytes gauge).
  size_t TotalMappedBytes() const;
  // Bytes of the mapped buffers of one worker (0 for an unknown worker).
  size_t WorkerMappedBytes(uint64_t worker_id) const;
  // Number of mapped buffers, all workers together.
  size_t NumBuffers() const;

 private:
  WorkerBuffers<ShmRegion> buffers_;
};

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_SHM_REGISTRY_H_
