// CountingTransport: an engine::Transport decorator that counts the bytes moved to and from each
// peer (dynamiq_peer_bytes_total) and otherwise forwards every call unchanged. The daemon wraps it
// around each job's cross-node transport (tcp, gloo, ...) and names each peer by its node rank (the
// transport's ranks are places in the job's group view: server/group_view.h).
//
// A send counts its size when Wait succeeds for it (a failed or never-waited send moved nothing we
// can vouch for). Received bytes are what the engine reports with MessageReceived once it has
// checked a message's header: its receives are posted with an upper bound on the size, and Gloo
// does not say how much arrived.
//
// Thread-safety as Transport: one thread drives it; Abort may come from any thread. The sink must
// be thread-safe (transports of several jobs report into one) and outlive the transport.
#ifndef DQ_SERVER_COUNTING_TRANSPORT_H_
#define DQ_SERVER_COUNTING_TRANSPORT_H_

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "engine/transport.h"

namespace dynamiq::server {

// Receives the counts (server/metrics.h implements it).
class PeerBytesSink {
 public:
  virtual ~PeerBytesSink() = default;
  virtual void AddPeerBytes(int peer, bool sent, uint64_t bytes) = 0;
};

class CountingTransport final : public engine::Transport {
 public:
  // `peer_nodes[r]`: the node rank of transport rank r (empty: the same numbers).
  CountingTransport(std::unique_ptr<engine::Transport> inner, PeerBytesSink* sink,
                    std::vector<uint32_t> peer_nodes = {});

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  engine::TransportCapabilities capabilities() const override { return inner_->capabilities(); }
  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override;
  absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override;
  bool SupportsParts() const override { return inner_->SupportsParts(); }
  absl::StatusOr<Handle> PostSendParts(int peer, uint64_t tag,
                                       absl::Span<const absl::Span<const uint8_t>> parts) override;
  absl::StatusOr<Handle> PostRecvParts(int peer, uint64_t tag, absl::Span<const absl::Span<uint8_t>> parts) override;
  absl::Status Wait(Handle handle, absl::Time deadline) override;
  void MessageReceived(int peer, size_t bytes) override;
  engine::DatagramTransport* datagrams() override { return inner_->datagrams(); }
  void Abort() override { inner_->Abort(); }

 private:
  struct Pending {
    int peer = 0;
    bool sent = false;
    uint64_t bytes = 0;
  };

  const std::unique_ptr<engine::Transport> inner_;
  PeerBytesSink* const sink_;
  const std::vector<uint32_t> peer_nodes_;
  // The node rank of transport rank `peer`.
  int NodeOf(int peer) const {
    return peer >= 0 && static_cast<size_t>(peer) < peer_nodes_.size() ? static_cast<int>(peer_nodes_[peer]) : peer;
  }
  absl::Mutex mu_;
  absl::flat_hash_map<Handle, Pending> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_COUNTING_TRANSPORT_H_
