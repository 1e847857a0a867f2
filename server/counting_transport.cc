#include "server/counting_transport.h"

#include <utility>

namespace dynamiq::server {

CountingTransport::CountingTransport(std::unique_ptr<engine::Transport> inner, PeerBytesSink* sink)
    : inner_(std::move(inner)), sink_(sink) {}

absl::StatusOr<engine::Transport::Handle> CountingTransport::PostSend(int peer, uint64_t tag,
                                                                      absl::Span<const uint8_t> data) {
  absl::StatusOr<Handle> handle = inner_->PostSend(peer, tag, data);
  if (handle.ok()) {
    absl::MutexLock lock(&mu_);
    pending_[*handle] = Pending{peer, true, data.size()};
  }
  return handle;
}

absl::StatusOr<engine::Transport::Handle> CountingTransport::PostRecv(int peer, uint64_t tag,
                                                                      absl::Span<uint8_t> buffer) {
  return inner_->PostRecv(peer, tag, buffer);
}

void CountingTransport::MessageReceived(int peer, size_t bytes) {
  if (sink_ != nullptr) sink_->AddPeerBytes(peer, false, bytes);
  inner_->MessageReceived(peer, bytes);
}

absl::Status CountingTransport::Wait(Handle handle, absl::Time deadline) {
  absl::Status status = inner_->Wait(handle, deadline);
  Pending p;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(handle);
    if (it == pending_.end()) return status;
    p = it->second;
    pending_.erase(it);
  }
  if (status.ok() && sink_ != nullptr) sink_->AddPeerBytes(p.peer, p.sent, p.bytes);
  return status;
}

}  // namespace dynamiq::server
