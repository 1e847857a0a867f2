#include "ipc/node_buffers.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace dynamiq::ipc {

NodeBuffers::NodeBuffers(ShmRegistry::Options shm) : shm_(shm) {}

absl::StatusOr<ShmBufferInfo> NodeBuffers::Allocate(uint64_t worker_id, size_t bytes) {
  return shm_.Allocate(worker_id, bytes);
}

absl::StatusOr<DeviceBufferInfo> NodeBuffers::AllocateDevice(uint64_t worker_id, size_t bytes) {
  if (device_ == nullptr) {
    return absl::FailedPreconditionError(
        "this dynamiqd runs with --device=cpu and hands out no CUDA device memory: allocate host (shared) memory, or "
        "run dynamiqd --device=cuda on a GPU node");
  }
  return device_->Allocate(worker_id, bytes);
}

absl::Status NodeBuffers::Mapped(uint64_t worker_id, uint64_t buffer_id) {
  if (!IsDeviceBufferId(buffer_id)) return shm_.Unlink(worker_id, buffer_id);
  if (device_ == nullptr) return UnknownDeviceBuffer(worker_id, buffer_id);
  return device_->Find(worker_id, buffer_id);
}

absl::StatusOr<BufferUse> NodeBuffers::Use(uint64_t worker_id, uint64_t buffer_id, size_t offset, size_t length) {
  if (!IsDeviceBufferId(buffer_id)) return shm_.Use(worker_id, buffer_id, offset, length);
  if (device_ == nullptr) return UnknownDeviceBuffer(worker_id, buffer_id);
  return device_->Use(worker_id, buffer_id, offset, length);
}

absl::Status NodeBuffers::Release(uint64_t worker_id, uint64_t buffer_id) {
  if (!IsDeviceBufferId(buffer_id)) return shm_.Release(worker_id, buffer_id);
  if (device_ == nullptr) return UnknownDeviceBuffer(worker_id, buffer_id);
  return device_->Release(worker_id, buffer_id);
}

void NodeBuffers::ReleaseWorker(uint64_t worker_id) {
  shm_.ReleaseWorker(worker_id);
  if (device_ != nullptr) device_->ReleaseWorker(worker_id);
}

absl::Status NodeBuffers::UnknownDeviceBuffer(uint64_t worker_id, uint64_t buffer_id) const {
  return absl::NotFoundError(absl::StrCat("device buffer ", buffer_id, " is not allocated to worker ", worker_id));
}

}  // namespace dynamiq::ipc
