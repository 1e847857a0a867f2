#include "ipc/shm_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace dynamiq::ipc {

ShmRegistry::ShmRegistry(Options options) : buffers_(options, {"shared-memory", "shared memory", "created"}, 1) {}

absl::StatusOr<ShmBufferInfo> ShmRegistry::Allocate(uint64_t worker_id, size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", worker_id, " asked for a 0-byte shared-memory buffer"));
  }
  if (bytes > kMaxShmRegionBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("worker %d asked for a %d-byte shared-memory buffer; the limit per buffer is %d bytes",
                        worker_id, bytes, kMaxShmRegionBytes));
  }
  DQ_ASSIGN_OR_RETURN(const auto reservation, buffers_.Reserve(worker_id, bytes));
  // Created without holding the lock (posix_fallocate touches every page).
  absl::StatusOr<ShmRegion> region =
      ShmRegion::Create(bytes, absl::StrCat("w", worker_id, "_b", reservation.buffer_id));
  ShmBufferInfo info;
  if (region.ok()) info = ShmBufferInfo{reservation.buffer_id, region->name(), region->size()};
  DQ_RETURN_IF_ERROR(buffers_.Commit(reservation, std::move(region)));
  return info;
}

absl::StatusOr<BufferUse> ShmRegistry::Use(uint64_t worker_id, uint64_t buffer_id, size_t offset, size_t length) {
  return buffers_.Use(worker_id, buffer_id, offset, length);
}

absl::Status ShmRegistry::Unlink(uint64_t worker_id, uint64_t buffer_id) {
  return buffers_.With(worker_id, buffer_id, [](ShmRegion& region) { return region.Unlink(); });
}

absl::Status ShmRegistry::Release(uint64_t worker_id, uint64_t buffer_id) {
  return buffers_.Release(worker_id, buffer_id);
}

size_t ShmRegistry::ReleaseWorker(uint64_t worker_id) { return buffers_.ReleaseWorker(worker_id); }

size_t ShmRegistry::TotalMappedBytes() const { return buffers_.TotalBytes(); }

size_t ShmRegistry::WorkerMappedBytes(uint64_t worker_id) const { return buffers_.WorkerBytes(worker_id); }

size_t ShmRegistry::NumBuffers() const { return buffers_.NumBuffers(); }

}  // namespace dynamiq::ipc
