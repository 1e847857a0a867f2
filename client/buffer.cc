#include "dynamiq/buffer.h"

#include <algorithm>
#include <utility>

#include "client/connection.h"

namespace dynamiq {
namespace {

// Gives the buffer back to the daemon (unless the registration is gone) and unmaps it; `impl` is
// empty afterwards whatever the daemon said.
absl::Status ReleaseImpl(std::unique_ptr<client::internal::BufferImpl>& impl, absl::Duration timeout) {
  if (impl == nullptr) return absl::OkStatus();
  std::unique_ptr<client::internal::BufferImpl> owned = std::move(impl);
  owned->uses->WaitIdle();  // an all-reduce in flight still uses the buffer: wait for its answer
  // A device buffer's mapping is closed before the daemon frees the memory behind it.
  absl::Status closed = owned->device_mapping.Close();
  absl::Status released = owned->connection->ReleaseBuffer(owned->id, timeout);  // `owned` unmaps on the way out
  return released.ok() ? closed : released;
}

}  // namespace

Buffer::Buffer() = default;

Buffer::Buffer(std::unique_ptr<client::internal::BufferImpl> impl)
    : impl_(std::move(impl)),
      data_(impl_->region.data()),
      device_data_(impl_->device_mapping.data()),
      device_(impl_->device_mapping.device()),
      size_(impl_->size),
      id_(impl_->id) {}

Buffer::Buffer(Buffer&& other) noexcept
    : impl_(std::move(other.impl_)),
      data_(std::exchange(other.data_, nullptr)),
      device_data_(std::exchange(other.device_data_, nullptr)),
      device_(std::exchange(other.device_, -1)),
      size_(std::exchange(other.size_, 0)),
      id_(std::exchange(other.id_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    if (impl_ != nullptr) {
      (void)ReleaseImpl(impl_, std::min(impl_->connection->options().timeout, client::internal::kTeardownTimeout));
    }
    impl_ = std::move(other.impl_);
    data_ = std::exchange(other.data_, nullptr);
    device_data_ = std::exchange(other.device_data_, nullptr);
    device_ = std::exchange(other.device_, -1);
    size_ = std::exchange(other.size_, 0);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

Buffer::~Buffer() {
  if (impl_ != nullptr) {
    (void)ReleaseImpl(impl_, std::min(impl_->connection->options().timeout, client::internal::kTeardownTimeout));
  }
}

absl::Status Buffer::Release() {
  data_ = nullptr;
  device_data_ = nullptr;
  device_ = -1;
  size_ = 0;
  id_ = 0;
  if (impl_ == nullptr) return absl::OkStatus();
  const absl::Duration timeout = impl_->connection->options().timeout;
  return ReleaseImpl(impl_, timeout);
}

}  // namespace dynamiq
