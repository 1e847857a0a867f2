// InMemoryTransport: the Transport for ranks that are threads of one process (tests, and the
// oracle the network transports are compared with). A shared MemoryHub holds one FIFO mailbox per
// (sender, receiver, tag); sends copy into it and complete at once, receives wait for a message.
// As Gloo, a message shorter than the posted receive fills its first bytes (the receiver learns the
// real size elsewhere: the engine's step header); a longer one, which would terminate a Gloo
// process, is an error here (DATA_LOSS naming both sizes).
// Thread-safe as Transport requires; MemoryHub::Abort fails every rank's pending and future Waits.
#ifndef DQ_ENGINE_MEMORY_TRANSPORT_H_
#define DQ_ENGINE_MEMORY_TRANSPORT_H_

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "engine/transport.h"

namespace dynamiq::engine {

class MemoryHub {
 public:
  explicit MemoryHub(int size) : size_(size) {}
  int size() const { return size_; }
  // Fails every pending and future Wait of every rank with ABORTED.
  void Abort();

 private:
  friend class InMemoryTransport;
  using Key = std::tuple<int, int, uint64_t>;  // from, to, tag
  const int size_;
  absl::Mutex mu_;
  std::map<Key, std::deque<std::vector<uint8_t>>> mailboxes_ ABSL_GUARDED_BY(mu_);
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
};

class InMemoryTransport final : public Transport {
 public:
  InMemoryTransport(std::shared_ptr<MemoryHub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return hub_->size(); }
  std::string name() const override { return "memory"; }
  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override;
  absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override;
  bool SupportsParts() const override { return true; }
  absl::StatusOr<Handle> PostSendParts(int peer, uint64_t tag,
                                       absl::Span<const absl::Span<const uint8_t>> parts) override;
  absl::StatusOr<Handle> PostRecvParts(int peer, uint64_t tag, absl::Span<const absl::Span<uint8_t>> parts) override;
  absl::Status Wait(Handle handle, absl::Time deadline) override;
  void Abort() override { hub_->Abort(); }

 private:
  struct Recv {
    int peer;
    uint64_t tag;
    std::vector<absl::Span<uint8_t>> parts;
  };
  std::shared_ptr<MemoryHub> hub_;
  const int rank_;
  Handle next_ = 1;
  std::map<Handle, Recv> recvs_;  // pending receives
  std::set<Handle> sends_;        // sends not yet waited for (complete when posted)
};

// `size` connected transports, one per rank.
std::vector<std::unique_ptr<Transport>> MakeMemoryTransports(int size);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_MEMORY_TRANSPORT_H_
