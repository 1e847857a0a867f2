#include "ipc/device_buffers.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace dynamiq::ipc {

DeviceBufferRegistry::DeviceBufferRegistry(std::unique_ptr<DeviceMemory> memory, Options options)
    : memory_(std::move(memory)),
      uuid_(memory_->uuid()),
      buffers_(options, {"device", "device memory", "allocated"}, kDeviceBufferIdBase) {}

absl::StatusOr<DeviceBufferInfo> DeviceBufferRegistry::Allocate(uint64_t worker_id, size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", worker_id, " asked for a 0-byte device buffer"));
  }
  if (bytes > kMaxDeviceBufferBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("worker %d asked for a %d-byte device buffer; the limit per buffer is %d bytes", worker_id,
                        bytes, kMaxDeviceBufferBytes));
  }
  DQ_ASSIGN_OR_RETURN(const auto reservation, buffers_.Reserve(worker_id, bytes));
  // Allocated without holding the lock.
  absl::StatusOr<DeviceMemory::Allocation> allocation = memory_->Allocate(bytes);
  if (!allocation.ok()) {
    return buffers_.Commit(reservation,
                           common::Annotate(allocation.status(),
                                            absl::StrCat("device buffer of ", bytes, " bytes for worker ", worker_id)));
  }
  DeviceBufferInfo info{reservation.buffer_id, bytes, allocation->ipc_handle, memory_->device(), uuid_};
  DQ_RETURN_IF_ERROR(buffers_.Commit(reservation, Buffer(memory_.get(), allocation->data, bytes)));
  return info;
}

absl::StatusOr<BufferUse> DeviceBufferRegistry::Use(uint64_t worker_id, uint64_t buffer_id, size_t offset,
                                                    size_t length) {
  return buffers_.Use(worker_id, buffer_id, offset, length);
}

absl::Status DeviceBufferRegistry::Find(uint64_t worker_id, uint64_t buffer_id) const {
  return buffers_.Find(worker_id, buffer_id);
}

absl::Status DeviceBufferRegistry::Release(uint64_t worker_id, uint64_t buffer_id) {
  return buffers_.Release(worker_id, buffer_id);
}

size_t DeviceBufferRegistry::ReleaseWorker(uint64_t worker_id) { return buffers_.ReleaseWorker(worker_id); }

size_t DeviceBufferRegistry::TotalBytes() const { return buffers_.TotalBytes(); }

size_t DeviceBufferRegistry::NumBuffers() const { return buffers_.NumBuffers(); }

}  // namespace dynamiq::ipc
