// BufferLimits: how much memory workers may hold in the buffers the daemon allocates for them
// (shared memory, ipc/shm_registry.h; device memory, ipc/device_buffers.h), and the
// admission check both registries apply to a new buffer.
#ifndef DQ_IPC_BUFFER_LIMITS_H_
#define DQ_IPC_BUFFER_LIMITS_H_

#include <stddef.h>
#include <stdint.h>

#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace dynamiq::ipc {

struct BufferLimits {
  // Bytes one worker may have allocated at once.
  size_t max_bytes_per_worker = std::numeric_limits<size_t>::max();
  // Bytes all workers together may have allocated at once.
  size_t max_total_bytes = std::numeric_limits<size_t>::max();
  // Buffers one worker may have allocated at once.
  size_t max_buffers_per_worker = 4096;
  // Buffers all workers together may have allocated at once.
  size_t max_total_buffers = std::numeric_limits<size_t>::max();
};

// Whether `used + bytes <= limit`, without overflow.
inline bool FitsLimit(size_t used, size_t bytes, size_t limit) { return used <= limit && bytes <= limit - used; }

// OK when worker `worker_id`, holding `worker_buffers` buffers of `worker_bytes` bytes while all
// workers hold `total_buffers` buffers of `total_bytes` (reservations included), may add a buffer
// of `bytes`; else
// RESOURCE_EXHAUSTED naming the limit. `kind` and `memory` name the buffers and their memory in
// messages ("shared-memory", "shared memory"; "device", "device memory").
inline absl::Status AdmitBuffer(const BufferLimits& limits, absl::string_view kind, absl::string_view memory,
                                uint64_t worker_id, size_t bytes, size_t worker_buffers, size_t worker_bytes,
                                size_t total_buffers, size_t total_bytes) {
  if (worker_buffers >= limits.max_buffers_per_worker) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("worker %d already has %d %s buffers, the per-worker limit; release some first", worker_id,
                        worker_buffers, kind));
  }
  if (total_buffers >= limits.max_total_buffers) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("workers already hold %d %s buffers, the daemon's limit (--max_buffers); worker %d must "
                        "release some, or others must end, before it gets another",
                        total_buffers, kind, worker_id));
  }
  if (!FitsLimit(worker_bytes, bytes, limits.max_bytes_per_worker)) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("worker %d asked for %d bytes of %s but already has %d of its %d-byte limit", worker_id, bytes,
                        memory, worker_bytes, limits.max_bytes_per_worker));
  }
  if (!FitsLimit(total_bytes, bytes, limits.max_total_bytes)) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("worker %d asked for %d bytes of %s but workers already have %d of the daemon's %d-byte limit",
                        worker_id, bytes, memory, total_bytes, limits.max_total_bytes));
  }
  return absl::OkStatus();
}

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_BUFFER_LIMITS_H_
