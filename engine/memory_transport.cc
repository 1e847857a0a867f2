#include "engine/memory_transport.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace dynamiq::engine {

void MemoryHub::Abort() {
  absl::MutexLock lock(&mu_);
  aborted_ = true;
}

absl::StatusOr<Transport::Handle> InMemoryTransport::PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) {
  return PostSendParts(peer, tag, {data});
}

absl::StatusOr<Transport::Handle> InMemoryTransport::PostSendParts(int peer, uint64_t tag,
                                                                   absl::Span<const absl::Span<const uint8_t>> parts) {
  if (peer < 0 || peer >= size() || peer == rank_) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " cannot send to rank ", peer));
  }
  std::vector<uint8_t> message;
  for (absl::Span<const uint8_t> part : parts) message.insert(message.end(), part.begin(), part.end());
  absl::MutexLock lock(&hub_->mu_);
  if (hub_->aborted_) return absl::AbortedError("transport aborted");
  hub_->mailboxes_[{rank_, peer, tag}].push_back(std::move(message));
  sends_.insert(next_);
  return next_++;
}

absl::StatusOr<Transport::Handle> InMemoryTransport::PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) {
  return PostRecvParts(peer, tag, {buffer});
}

absl::StatusOr<Transport::Handle> InMemoryTransport::PostRecvParts(int peer, uint64_t tag,
                                                                   absl::Span<const absl::Span<uint8_t>> parts) {
  if (peer < 0 || peer >= size() || peer == rank_) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " cannot receive from rank ", peer));
  }
  const Handle h = next_++;
  recvs_[h] = Recv{peer, tag, {parts.begin(), parts.end()}};
  return h;
}

absl::Status InMemoryTransport::Wait(Handle handle, absl::Time deadline) {
  if (sends_.erase(handle) != 0) return absl::OkStatus();  // complete when posted
  auto it = recvs_.find(handle);
  if (it == recvs_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, ": no operation with handle ", handle));
  }
  const Recv r = it->second;
  recvs_.erase(it);
  const MemoryHub::Key key{r.peer, rank_, r.tag};
  absl::MutexLock lock(&hub_->mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hub_->mu_) {
    if (hub_->aborted_) return true;
    auto box = hub_->mailboxes_.find(key);
    return box != hub_->mailboxes_.end() && !box->second.empty();
  };
  if (!hub_->mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("rank ", rank_, ": timed out waiting for a message from rank ", r.peer, " (tag ", r.tag, ")"));
  }
  if (hub_->aborted_) return absl::AbortedError(absl::StrCat("rank ", rank_, ": transport aborted"));
  auto& box = hub_->mailboxes_[key];
  std::vector<uint8_t> message = std::move(box.front());
  box.pop_front();
  size_t capacity = 0;
  for (absl::Span<uint8_t> part : r.parts) capacity += part.size();
  if (message.size() > capacity) {
    return absl::DataLossError(absl::StrCat("rank ", rank_, ": rank ", r.peer, " sent ", message.size(),
                                            " bytes into a ", capacity, "-byte receive (tag ", r.tag, ")"));
  }
  size_t copied = 0;
  for (absl::Span<uint8_t> part : r.parts) {
    const size_t n = std::min(part.size(), message.size() - copied);
    if (n > 0) std::memcpy(part.data(), message.data() + copied, n);
    copied += n;
  }
  return absl::OkStatus();
}

std::vector<std::unique_ptr<Transport>> MakeMemoryTransports(int size) {
  auto hub = std::make_shared<MemoryHub>(size);
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<InMemoryTransport>(hub, r));
  return out;
}

}  // namespace dynamiq::engine
