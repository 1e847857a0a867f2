#include "server/counting_transport.h"

#include <utility>

namespace dynamiq::server {

CountingTransport::CountingTransport(std::unique_ptr<engine::Transport> inner, PeerBytesSink* sink,
                                     std::vector<uint32_t> peer_nodes)
    : inner_(std::move(inner)), sink_(sink), peer_nodes_(std::move(peer_nodes)) {}

absl::StatusOr<engine::Transport::Handle> CountingTransport::PostSend(int peer, uint64_t tag,
                                                                      absl::Span<const uint8_t> data) {
  return PostSendParts(peer, tag, {data});
}

absl::StatusOr<engine::Transport::Handle> CountingTransport::PostSendParts(
    int peer, uint64_t tag, absl::Span<const absl::Span<const uint8_t>> parts) {
  absl::StatusOr<Handle> handle =
      parts.size() == 1 ? inner_->PostSend(peer, tag, parts[0]) : inner_->PostSendParts(peer, tag, parts);
  if (handle.ok()) {
    uint64_t bytes = 0;
    for (absl::Span<const uint8_t> part : parts) bytes += part.size();
    absl::MutexLock lock(&mu_);
    pending_[*handle] = Pending{peer, true, bytes};
  }
  return handle;
}

absl::StatusOr<engine::Transport::Handle> CountingTransport::PostRecv(int peer, uint64_t tag,
                                                                      absl::Span<uint8_t> buffer) {
  return inner_->PostRecv(peer, tag, buffer);
}

absl::StatusOr<engine::Transport::Handle> CountingTransport::PostRecvParts(
    int peer, uint64_t tag, absl::Span<const absl::Span<uint8_t>> parts) {
  return inner_->PostRecvParts(peer, tag, parts);
}

void CountingTransport::MessageReceived(int peer, size_t bytes) {
  if (sink_ != nullptr) sink_->AddPeerBytes(NodeOf(peer), false, bytes);
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
  if (status.ok() && sink_ != nullptr) sink_->AddPeerBytes(NodeOf(p.peer), p.sent, p.bytes);
  return status;
}

}  // namespace dynamiq::server
