// Buffer: a region of memory that dynamiqd allocated for one worker and that both use: shared
// memory both map (MemoryKind::kHost), or on a GPU node memory of the daemon's CUDA device that this
// process opened through a CUDA IPC handle (MemoryKind::kCudaDevice). Include <dynamiq/client.h>
// rather than this header.
//
// Gradients are written into a Buffer and all-reduced in place (Client::AllReduce); the daemon
// reads the worker's contribution from it and writes the result back into it. A device buffer is
// read by the daemon on its own CUDA stream: finish writing it (synchronize the stream that wrote
// it) before submitting the all-reduce; once the all-reduce completed, the result is in device
// memory, visible to any later work on the device.
//
// Thread-safety: data(), size(), id() and valid() may be called concurrently. Release(), moves
// and destruction need exclusive access. Releasing a buffer (Release(), the destructor, or moving
// another buffer into it) first waits until every all-reduce on it has returned (each ends at the
// latest at ClientOptions::timeout). Nobody may touch the bytes of a region while an all-reduce on
// that region is in flight (the daemon reads and writes them).
#ifndef DQ_CLIENT_INCLUDE_DYNAMIQ_BUFFER_H_
#define DQ_CLIENT_INCLUDE_DYNAMIQ_BUFFER_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>

#include "absl/status/status.h"
#include "dynamiq/options.h"

namespace dynamiq {

class Client;
namespace client::internal {
struct BufferImpl;
}  // namespace client::internal

/// A mapped shared-memory buffer, or an opened device buffer, owned by one Client's registration.
/// Move-only.
///
/// Obtain one from Client::Allocate(). Releasing it (Release() or the destructor) unmaps this
/// process's side (a device buffer: closes its CUDA IPC mapping first) and tells the daemon to free
/// its side (ReleaseBuffer). A Buffer may outlive its
/// Client, but it can only be all-reduced through the Client that allocated it.
class Buffer {
 public:
  /// An empty buffer (valid() is false), as is a moved-from one.
  Buffer();
  Buffer(Buffer&& other) noexcept;
  /// Releases the buffer held before (ignoring errors), then takes `other`'s.
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  /// Releases the buffer like Release(), ignoring errors, with a deadline of at most 5 seconds.
  ~Buffer();

  /// Waits until no all-reduce on the buffer is in flight, then asks the daemon to free the buffer
  /// and unmaps it; the buffer is empty afterwards even if the daemon call failed (the status says
  /// why). OK on an empty buffer.
  absl::Status Release();

  /// Start of the mapping (page-aligned) of a host buffer; nullptr for a device buffer or an empty
  /// buffer.
  void* data() const { return data_; }
  /// Start of a device buffer: a device pointer valid in this process on CUDA device device()
  /// (256-byte aligned); nullptr for a host buffer or an empty buffer.
  void* device_data() const { return device_data_; }
  /// Where the buffer lives (kHost for an empty buffer).
  MemoryKind memory_kind() const { return device_data_ != nullptr ? MemoryKind::kCudaDevice : MemoryKind::kHost; }
  /// The CUDA device (ordinal in this process) of a device buffer; -1 otherwise.
  int device() const { return device_; }
  /// Usable bytes: at least the size asked of Client::Allocate().
  size_t size() const { return size_; }
  /// The daemon's id of the buffer, unique within the Client's registration (0 when empty).
  uint64_t id() const { return id_; }
  /// False for an empty (default-constructed, moved-from or released) buffer.
  bool valid() const { return data_ != nullptr || device_data_ != nullptr; }

 private:
  friend class Client;
  explicit Buffer(std::unique_ptr<client::internal::BufferImpl> impl);

  std::unique_ptr<client::internal::BufferImpl> impl_;
  void* data_ = nullptr;
  void* device_data_ = nullptr;
  int device_ = -1;
  size_t size_ = 0;
  uint64_t id_ = 0;
};

}  // namespace dynamiq

#endif  // DQ_CLIENT_INCLUDE_DYNAMIQ_BUFFER_H_
