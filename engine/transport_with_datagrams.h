// TransportWithDatagrams: a group's reliable transport and its datagram transport (engine/
// datagram_transport.h) as one engine::Transport: every Transport call goes to the reliable one,
// datagrams() hands out the other, and Abort aborts both. What a node of dynamiqd --transport=udp
// connects per group view: the reliable schedules (and exact all-reduces) use the first, the
// loss-tolerant all-reduce (engine/lossy_all_reduce.h) the second. Both must have the same ranks.
// Thread-safety: as the two transports'.
#ifndef DQ_ENGINE_TRANSPORT_WITH_DATAGRAMS_H_
#define DQ_ENGINE_TRANSPORT_WITH_DATAGRAMS_H_

#include <memory>
#include <string>
#include <utility>

#include "engine/datagram_transport.h"
#include "engine/transport.h"

namespace dynamiq::engine {

class TransportWithDatagrams final : public Transport {
 public:
  TransportWithDatagrams(std::unique_ptr<Transport> reliable, std::unique_ptr<DatagramTransport> datagrams)
      : reliable_(std::move(reliable)), datagrams_(std::move(datagrams)) {}

  int rank() const override { return reliable_->rank(); }
  int size() const override { return reliable_->size(); }
  std::string name() const override { return reliable_->name(); }
  TransportCapabilities capabilities() const override { return reliable_->capabilities(); }
  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override {
    return reliable_->PostSend(peer, tag, data);
  }
  absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override {
    return reliable_->PostRecv(peer, tag, buffer);
  }
  bool SupportsParts() const override { return reliable_->SupportsParts(); }
  absl::StatusOr<Handle> PostSendParts(int peer, uint64_t tag,
                                       absl::Span<const absl::Span<const uint8_t>> parts) override {
    return reliable_->PostSendParts(peer, tag, parts);
  }
  absl::StatusOr<Handle> PostRecvParts(int peer, uint64_t tag, absl::Span<const absl::Span<uint8_t>> parts) override {
    return reliable_->PostRecvParts(peer, tag, parts);
  }
  absl::Status Wait(Handle handle, absl::Time deadline) override { return reliable_->Wait(handle, deadline); }
  void MessageReceived(int peer, size_t bytes) override { reliable_->MessageReceived(peer, bytes); }
  DatagramTransport* datagrams() override { return datagrams_.get(); }
  void Abort() override {
    datagrams_->Abort();
    reliable_->Abort();
  }

 private:
  const std::unique_ptr<Transport> reliable_;
  const std::unique_ptr<DatagramTransport> datagrams_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_TRANSPORT_WITH_DATAGRAMS_H_
