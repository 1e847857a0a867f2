// DeviceBufferRegistry: the daemon's table of CUDA device buffers handed out to local worker
// processes on a GPU node (dynamiqd --device=cuda), keyed by (worker id, buffer id): the device
// counterpart of ShmRegistry (ipc/shm_registry.h), with the same role and limits. The daemon
// allocates a buffer when a worker asks for one and sends it the DeviceBufferInfo (a CUDA IPC
// memory handle the worker opens with cudaIpcOpenMemHandle), resolves the (buffer, offset, length)
// regions named by all-reduce requests with Use(), and frees everything a worker had when it
// unregisters or dies (ReleaseWorker()) and, at shutdown, everything (the destructor).
//
// The memory itself comes from a DeviceMemory (server/cuda_device.h: cudaMalloc +
// cudaIpcGetMemHandle on the daemon's device), so the registry is CUDA-free and its bookkeeping is
// tested without a GPU.
//
// Buffer ids start at kDeviceBufferIdBase, above any id ShmRegistry hands out, so one id names one
// buffer whatever its kind (IsDeviceBufferId) and a request needs no extra field. Ids are never
// reused, so a stale id is NOT_FOUND rather than someone else's memory.
//
// Limits: a per-worker and a global byte limit, and a per-worker buffer count limit. Allocations
// beyond them fail with RESOURCE_EXHAUSTED and change nothing.
//
// The bookkeeping is ipc/worker_buffers.h, shared with ShmRegistry.
//
// Thread-safety: every method is thread-safe (one absl::Mutex). Allocating and freeing device
// memory run outside the lock. A region returned by Use() stays allocated while the BufferUse
// lives: Release() refuses the buffer meanwhile and ReleaseWorker() frees it only when the use
// ends. The registry outlives the uses.
#ifndef DQ_IPC_DEVICE_BUFFERS_H_
#define DQ_IPC_DEVICE_BUFFERS_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "ipc/buffer_limits.h"
#include "ipc/worker_buffers.h"

namespace dynamiq::ipc {

// The first device buffer id; shared-memory buffer ids stay below it.
inline constexpr uint64_t kDeviceBufferIdBase = uint64_t{1} << 48;
inline bool IsDeviceBufferId(uint64_t buffer_id) { return buffer_id >= kDeviceBufferIdBase; }

// Largest device buffer a worker may ask for (as kMaxShmRegionBytes for shared memory).
inline constexpr size_t kMaxDeviceBufferBytes = size_t{1} << 40;

// Exportable device memory of one device. Implementations are thread-safe.
class DeviceMemory {
 public:
  struct Allocation {
    void* data = nullptr;    // device pointer in this process
    std::string ipc_handle;  // the bytes of its cudaIpcMemHandle_t
  };
  virtual ~DeviceMemory() = default;
  // `bytes` (> 0) of zeroed device memory and its IPC handle. RESOURCE_EXHAUSTED when the device
  // is out of memory; INTERNAL for other device errors.
  virtual absl::StatusOr<Allocation> Allocate(size_t bytes) = 0;
  // Frees what Allocate returned (errors are logged: nothing can be done about them).
  virtual void Free(void* data) = 0;
  // The device's ordinal in this process and its 16-byte UUID.
  virtual int device() const = 0;
  virtual std::string uuid() const = 0;
};

// What a worker needs to open a buffer: cudaIpcOpenMemHandle(ipc_handle) on the device whose UUID
// is `device_uuid`.
struct DeviceBufferInfo {
  uint64_t buffer_id = 0;
  size_t size = 0;
  std::string ipc_handle;
  int device = 0;
  std::string device_uuid;
};

class DeviceBufferRegistry {
 public:
  using Options = BufferLimits;

  DeviceBufferRegistry(std::unique_ptr<DeviceMemory> memory, Options options);
  // The destructor frees every buffer.

  // Allocates `bytes` of device memory for `worker_id`. INVALID_ARGUMENT for a zero or oversized
  // request, RESOURCE_EXHAUSTED over a limit or when the device is out of memory, ABORTED if the
  // worker was released meanwhile.
  absl::StatusOr<DeviceBufferInfo> Allocate(uint64_t worker_id, size_t bytes);
  // The device bytes [offset, offset + length) of a buffer of `worker_id` (a span over DEVICE
  // memory: never dereference it on the host). NOT_FOUND for an unknown buffer (including another
  // worker's), OUT_OF_RANGE if the region does not lie inside the buffer. The buffer is in use
  // until the result (and its copies) is gone.
  absl::StatusOr<BufferUse> Use(uint64_t worker_id, uint64_t buffer_id, size_t offset, size_t length);
  // OK if `worker_id` has the buffer, else NOT_FOUND.
  absl::Status Find(uint64_t worker_id, uint64_t buffer_id) const;
  // Frees one buffer. NOT_FOUND for an unknown buffer, FAILED_PRECONDITION for one in use.
  absl::Status Release(uint64_t worker_id, uint64_t buffer_id);
  // Frees every buffer of `worker_id` (none is fine; one in use when its use ends) and returns how
  // many there were.
  size_t ReleaseWorker(uint64_t worker_id);

  size_t TotalBytes() const;
  size_t NumBuffers() const;
  int device() const { return memory_->device(); }
  const std::string& device_uuid() const { return uuid_; }

 private:
  // Device memory that goes back to `memory` when destroyed.
  class Buffer {
   public:
    Buffer(DeviceMemory* memory, void* data, size_t size) : memory_(memory), data_(data), size_(size) {}
    Buffer(Buffer&& other) noexcept
        : memory_(other.memory_), data_(std::exchange(other.data_, nullptr)), size_(other.size_) {}
    Buffer& operator=(Buffer&& other) noexcept {
      if (this != &other) {
        Free();
        memory_ = other.memory_;
        data_ = std::exchange(other.data_, nullptr);
        size_ = other.size_;
      }
      return *this;
    }
    ~Buffer() { Free(); }
    uint8_t* data() const { return static_cast<uint8_t*>(data_); }
    size_t size() const { return size_; }

   private:
    void Free() {
      if (data_ != nullptr) memory_->Free(data_);
      data_ = nullptr;
    }
    DeviceMemory* memory_;
    void* data_;
    size_t size_;
  };

  const std::unique_ptr<DeviceMemory> memory_;  // outlives buffers_
  const std::string uuid_;
  WorkerBuffers<Buffer> buffers_;
};

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_DEVICE_BUFFERS_H_
