// NodeBuffers: every buffer a daemon hands to its local workers, behind one API: shared memory
// (ShmRegistry) always, and device memory (DeviceBufferRegistry) on a GPU node. A buffer id says
// which registry holds it (IsDeviceBufferId), so callers pass ids through without asking.
//
// Thread-safe like the registries. SetDevice must be called, if at all, before the first worker
// call; the registries (and so the memory) live until the NodeBuffers is destroyed.
#ifndef DQ_IPC_NODE_BUFFERS_H_
#define DQ_IPC_NODE_BUFFERS_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ipc/device_buffers.h"
#include "ipc/shm_registry.h"
#include "ipc/worker_buffers.h"

namespace dynamiq::ipc {

class NodeBuffers {
 public:
  explicit NodeBuffers(ShmRegistry::Options shm);

  // Makes device buffers available (a GPU node).
  void SetDevice(std::unique_ptr<DeviceBufferRegistry> device) { device_ = std::move(device); }

  // A shared-memory buffer (ShmRegistry::Allocate).
  absl::StatusOr<ShmBufferInfo> Allocate(uint64_t worker_id, size_t bytes);
  // A device buffer (DeviceBufferRegistry::Allocate); FAILED_PRECONDITION without a device.
  absl::StatusOr<DeviceBufferInfo> AllocateDevice(uint64_t worker_id, size_t bytes);
  // The worker has mapped the buffer: a shared-memory buffer's name is unlinked (nothing leaks after
  // a crash); a device buffer has no name, so this only checks that it exists. NOT_FOUND if unknown.
  absl::Status Mapped(uint64_t worker_id, uint64_t buffer_id);
  // The bytes [offset, offset + length) of either kind of buffer, in use until the result is gone
  // (the registries' Use: NOT_FOUND, OUT_OF_RANGE).
  absl::StatusOr<BufferUse> Use(uint64_t worker_id, uint64_t buffer_id, size_t offset, size_t length);
  // Frees one buffer (FAILED_PRECONDITION while an all-reduce uses it, NOT_FOUND if unknown).
  absl::Status Release(uint64_t worker_id, uint64_t buffer_id);
  // Frees every buffer of the worker, of both kinds (those in use when their use ends).
  void ReleaseWorker(uint64_t worker_id);

  // Shared memory mapped for all workers together (the metrics' dynamiq_shm_mapped_bytes).
  size_t TotalMappedBytes() const { return shm_.TotalMappedBytes(); }

 private:
  absl::Status UnknownDeviceBuffer(uint64_t worker_id, uint64_t buffer_id) const;

  ShmRegistry shm_;
  std::unique_ptr<DeviceBufferRegistry> device_;  // GPU nodes
};

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_NODE_BUFFERS_H_
