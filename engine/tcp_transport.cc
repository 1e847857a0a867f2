#include "engine/tcp_transport.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/little_endian.h"
#include "common/safe_text.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "engine/tcp_hello.h"

namespace dynamiq::engine {
namespace {

constexpr size_t kFrameBytes = 16;  // tag, size: little-endian u64 each
// A frame with this tag says why its sender gave up (the reason, UTF-8, follows; on a keyed
// connection then its MAC, engine/tcp_hello.h GaveUpMac); the engine's tags never have every bit set.
constexpr uint64_t kAbortTag = ~uint64_t{0};
constexpr size_t kMaxAbortReason = 1024;
constexpr size_t kAbortMacBytes = common::HmacSha256::kBytes;
// What a message kept before its receive costs beyond its payload (its entry, queue and buffer
// headers): charged against max_early_bytes so that many tiny messages cannot grow the process
// without bound.
constexpr size_t kEarlyMessageCost = 1024;
// What Abort still sends of the messages posted to a peer (a step header that tells the peer why
// the collective failed), as far as the socket takes it without waiting.
constexpr size_t kAbortFlushBytes = size_t{64} << 10;
// How long Abort waits for a writer to finish the message it is writing before it flushes.
constexpr absl::Duration kAbortWriterWait = absl::Milliseconds(200);

// A posted buffer: the parts of one message, in order.
using Parts = std::vector<absl::Span<uint8_t>>;

size_t TotalBytes(const Parts& parts) {
  size_t total = 0;
  for (absl::Span<uint8_t> part : parts) total += part.size();
  return total;
}

// Fills `frame` for a message of `parts` with `tag`; the iovecs of the frame and the parts.
std::vector<iovec> FrameIovecs(uint8_t (&frame)[kFrameBytes], uint64_t tag, const Parts& parts) {
  common::PutLe<uint64_t>(frame, tag);
  common::PutLe<uint64_t>(frame + 8, TotalBytes(parts));
  std::vector<iovec> iov = {{frame, kFrameBytes}};
  for (absl::Span<uint8_t> part : parts) {
    if (!part.empty()) iov.push_back({part.data(), part.size()});
  }
  return iov;
}

// Writes the message's frame and then its parts, in one sendmsg where the socket takes it all;
// false on error.
bool WriteFrame(int fd, uint64_t tag, const Parts& parts) {
  uint8_t frame[kFrameBytes];
  std::vector<iovec> iov = FrameIovecs(frame, tag, parts);
  iovec* next = iov.data();
  size_t count = iov.size();
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = next;
    msg.msg_iovlen = std::min<size_t>(count, IOV_MAX);
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    size_t sent = static_cast<size_t>(n);
    while (count > 0 && sent >= next->iov_len) {
      sent -= next->iov_len;
      ++next;
      --count;
    }
    if (count > 0) {
      next->iov_base = static_cast<uint8_t*>(next->iov_base) + sent;
      next->iov_len -= sent;
    }
  }
  return true;
}

// The same without waiting; true only if all of it went into the socket.
bool WriteFrameNow(int fd, uint64_t tag, const Parts& parts) {
  uint8_t frame[kFrameBytes];
  std::vector<iovec> iov = FrameIovecs(frame, tag, parts);
  msghdr msg{};
  msg.msg_iov = iov.data();
  msg.msg_iovlen = std::min<size_t>(iov.size(), IOV_MAX);
  const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  return n >= 0 && static_cast<size_t>(n) == kFrameBytes + TotalBytes(parts);
}

// Copies `bytes` into the parts, in order.
void Scatter(absl::Span<const uint8_t> bytes, const Parts& parts) {
  for (absl::Span<uint8_t> part : parts) {
    const size_t n = std::min(part.size(), bytes.size());
    if (n > 0) std::memcpy(part.data(), bytes.data(), n);
    bytes.remove_prefix(n);
  }
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(int rank, int size, size_t max_early_bytes, size_t max_early_messages)
      : rank_(rank),
        size_(size),
        max_early_bytes_(max_early_bytes),
        max_early_messages_(max_early_messages),
        peers_(size) {}

  ~TcpTransport() override {
    Abort();
    for (auto& p : peers_) {
      if (p == nullptr) continue;
      if (p->reader.joinable()) p->reader.join();
      if (p->writer.joinable()) p->writer.join();
      close(p->fd);
    }
  }

  // Takes the introduced connection of a peer.
  void AddPeer(TcpLink link) {
    auto& p = peers_[link.peer] = std::make_unique<Peer>();
    p->rank = link.peer;
    p->fd = link.fd;
    p->session = std::move(link.session);
  }
  // Once every peer is added: starts each one's reader and writer.
  void Start() {
    for (int q = 0; q < size_; ++q) {
      if (peers_[q] == nullptr) continue;
      peers_[q]->reader = std::thread([this, q] { ReadLoop(q); });
      peers_[q]->writer = std::thread([this, q] { WriteLoop(q); });
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "tcp"; }

  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override {
    return PostSendParts(peer, tag, {data});
  }
  absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override {
    return PostRecvParts(peer, tag, {buffer});
  }
  bool SupportsParts() const override { return true; }

  absl::StatusOr<Handle> PostSendParts(int peer, uint64_t tag,
                                       absl::Span<const absl::Span<const uint8_t>> parts) override {
    DQ_RETURN_IF_ERROR(CheckPeer(peer));
    if (tag == kAbortTag) return absl::InvalidArgumentError(absl::StrCat(Who(), ": tag ", tag, " is reserved"));
    Parts writable;  // never written: sends only read their parts
    for (absl::Span<const uint8_t> part : parts) writable.emplace_back(const_cast<uint8_t*>(part.data()), part.size());
    absl::MutexLock lock(&mu_);
    DQ_RETURN_IF_ERROR(failed_);
    // A peer already lost fails the send at its Wait, not here: what the peer sent before it left
    // (a bad header, say: the first error) is still delivered, and the caller that waits for it
    // first reports that, whatever order it posted in.
    const Handle h = next_++;
    Op& op = *(ops_[h] = std::make_unique<Op>(Op{true, peer, tag, std::move(writable)}));
    peers_[peer]->sends.push_back(&op);
    return h;
  }

  absl::StatusOr<Handle> PostRecvParts(int peer, uint64_t tag, absl::Span<const absl::Span<uint8_t>> parts) override {
    DQ_RETURN_IF_ERROR(CheckPeer(peer));
    absl::MutexLock lock(&mu_);
    DQ_RETURN_IF_ERROR(failed_);
    const Handle h = next_++;
    Op& op = *(ops_[h] = std::make_unique<Op>(Op{false, peer, tag, Parts(parts.begin(), parts.end())}));
    peers_[peer]->recvs[tag].push_back(&op);
    DeliverEarly(peer, tag);
    return h;
  }

  absl::Status Wait(Handle handle, absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    auto it = ops_.find(handle);
    if (it == ops_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(Who(), ": Wait on unknown handle ", handle, " (never posted or already waited)"));
    }
    Op* op = it->second.get();
    const Peer& peer = *peers_[op->peer];
    // A send the writer is still inside completes, or fails, there: the peer may have read it,
    // finished its part of the collective and left (its transport gives up when destroyed) in the
    // moment before the writer marks it done.
    auto finished = [this, op, &peer]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      const bool writing = op->send && peer.writing && !peer.sends.empty() && peer.sends.front() == op;
      return op->done || !failed_.ok() || (!peer.status.ok() && !writing);
    };
    mu_.AwaitWithDeadline(absl::Condition(&finished), deadline);
    if (op->done) {
      ops_.erase(it);
      return absl::OkStatus();
    }
    if (!failed_.ok()) return failed_;
    if (!peer.status.ok()) return peer.status;
    return absl::DeadlineExceededError(absl::StrCat(Who(), ": ", op->send ? "send to" : "receive from", " rank ",
                                                    op->peer, " (tag ", op->tag, ") did not complete in time"));
  }

  // Before the sockets close, each peer whose writer is idle gets what was posted to it that the
  // socket takes without waiting (up to kAbortFlushBytes: a step header saying this rank runs a
  // different collective reaches the peer, which then names the mismatch itself) and a frame saying
  // why this rank gave up (a peer lost first, say), which the peer's error carries.
  void Abort() override {
    absl::MutexLock lock(&mu_);
    if (failed_.ok()) {
      // Writers finish the message they are writing (briefly: a peer that reads nothing must not
      // hold Abort up) and start no other. A second Abort meanwhile waits too; whichever wakes
      // first flushes and fails the transport.
      aborting_ = true;
      auto quiet = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        for (const auto& p : peers_) {
          if (p != nullptr && p->writing) return false;
        }
        return true;
      };
      mu_.AwaitWithTimeout(absl::Condition(&quiet), kAbortWriterWait);
    }
    if (failed_.ok()) {
      const std::string why =
          std::string((!first_loss_.ok() ? first_loss_ : absl::AbortedError(absl::StrCat(Who(), ": transport aborted")))
                          .message()
                          .substr(0, kMaxAbortReason));
      for (auto& p : peers_) {
        if (p == nullptr || !p->status.ok() || p->writing) continue;
        size_t budget = kAbortFlushBytes;
        bool whole = true;
        for (const Op* op : p->sends) {
          if (op->size > budget || !(whole = WriteFrameNow(p->fd, op->tag, op->parts))) break;
          budget -= op->size;
        }
        if (!whole) continue;
        std::string reason = why;
        if (p->session != nullptr) {
          const common::HmacSha256::Digest mac = GaveUpMac(*p->session, rank_, p->rank, why);
          reason.append(reinterpret_cast<const char*>(mac.data()), mac.size());
        }
        WriteFrameNow(p->fd, kAbortTag, {absl::MakeSpan(reinterpret_cast<uint8_t*>(reason.data()), reason.size())});
      }
    }
    Fail(absl::AbortedError(absl::StrCat(Who(), ": transport aborted")));
    // Until every thread is out of the buffers the callers posted: they may free them next.
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return busy_ == 0; };
    mu_.Await(absl::Condition(&idle));
  }

 private:
  struct Op {
    bool send;
    int peer;
    uint64_t tag;
    Parts parts;
    size_t size = TotalBytes(parts);
    bool done = false;
  };
  struct Early {  // a message that came before its receive
    std::vector<uint8_t> bytes;
    bool complete = false;  // its payload is read
  };
  struct Peer {
    int rank = -1;
    int fd = -1;
    std::shared_ptr<const common::HmacSha256> session;  // keyed connections: MACs "gave up" frames
    absl::Status status;                                // not OK once its connection is closed or broken
    std::thread reader, writer;
    bool writing = false;                         // the writer is inside the socket
    std::deque<Op*> sends;                        // in posting order; the front is being written
    std::map<uint64_t, std::deque<Op*>> recvs;    // per tag, in posting order
    std::map<uint64_t, std::deque<Early>> early;  // per tag, in arrival order
    size_t early_messages = 0;                    // in `early`
  };

  std::string Who() const { return absl::StrCat("tcp transport rank ", rank_); }

  absl::Status CheckPeer(int peer) const {
    if (peer < 0 || peer >= size_ || peer == rank_) {
      return absl::InvalidArgumentError(absl::StrCat(Who(), ": no peer ", peer, " in a group of ", size_));
    }
    return absl::OkStatus();
  }

  // The first failure wins; every socket is shut down so blocked threads return.
  void Fail(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!failed_.ok()) return;
    failed_ = std::move(status);
    for (auto& p : peers_) {
      if (p != nullptr) shutdown(p->fd, SHUT_RDWR);
    }
  }

  // Hands complete early messages of `tag` to receives posted for it, in order.
  void DeliverEarly(int peer, uint64_t tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Peer& p = *peers_[peer];
    auto e = p.early.find(tag);
    auto r = p.recvs.find(tag);
    while (e != p.early.end() && !e->second.empty() && e->second.front().complete && r != p.recvs.end() &&
           !r->second.empty()) {
      Early& m = e->second.front();
      Op* op = r->second.front();
      if (m.bytes.size() > op->size) {
        Fail(absl::InvalidArgumentError(absl::StrCat(Who(), ": a message of ", m.bytes.size(), " bytes from rank ",
                                                     peer, " (tag ", tag, ") for a receive of ", op->size, " bytes")));
        return;
      }
      Scatter(m.bytes, op->parts);
      early_bytes_ -= m.bytes.size() + kEarlyMessageCost;
      --p.early_messages;
      op->done = true;
      e->second.pop_front();
      r->second.pop_front();
    }
    if (e != p.early.end() && e->second.empty()) p.early.erase(e);
    if (r != p.recvs.end() && r->second.empty()) p.recvs.erase(r);
  }

  void ReadLoop(int peer) {
    Peer& p = *peers_[peer];
    uint8_t frame[kFrameBytes];
    while (true) {
      if (absl::Status read = Read(peer, frame, kFrameBytes); !read.ok()) return LostPeer(peer, read);
      const uint64_t tag = common::GetLe<uint64_t>(frame), size = common::GetLe<uint64_t>(frame + 8);
      if (tag == kAbortTag) return LostPeer(peer, ReadGaveUp(peer, size));
      Op* op = nullptr;
      Early* early = nullptr;
      {
        absl::MutexLock lock(&mu_);
        // Straight into a posted receive when nothing of this tag is waiting before it; otherwise
        // kept, as long as the early bytes fit (else the peer waits for the receive to be posted).
        auto direct = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          auto r = p.recvs.find(tag);
          return r != p.recvs.end() && !r->second.empty() && p.early.count(tag) == 0;
        };
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !failed_.ok() || direct() ||
                 (size <= max_early_bytes_ - early_bytes_ &&
                  max_early_bytes_ - early_bytes_ - size >= kEarlyMessageCost &&
                  p.early_messages < max_early_messages_);
        };
        mu_.Await(absl::Condition(&ready));
        if (!failed_.ok()) return;
        if (direct()) {
          auto r = p.recvs.find(tag);
          op = r->second.front();
          if (size > op->size) {
            Fail(absl::InvalidArgumentError(absl::StrCat(Who(), ": a message of ", size, " bytes from rank ", peer,
                                                         " (tag ", tag, ") for a receive of ", op->size, " bytes")));
            return;
          }
          r->second.pop_front();
          if (r->second.empty()) p.recvs.erase(r);
        } else {
          early_bytes_ += size + kEarlyMessageCost;
          ++p.early_messages;
          early = &p.early[tag].emplace_back();
          early->bytes.resize(size);
        }
        ++busy_;
      }
      const absl::Status read =
          op != nullptr ? Read(peer, op->parts, size) : Read(peer, {absl::MakeSpan(early->bytes)}, size);
      absl::MutexLock lock(&mu_);
      --busy_;
      if (!read.ok()) return LostPeerLocked(peer, read);
      if (op != nullptr) {
        op->done = true;
      } else {
        early->complete = true;
        DeliverEarly(peer, tag);
      }
    }
  }

  void WriteLoop(int peer) {
    Peer& p = *peers_[peer];
    while (true) {
      Op* op = nullptr;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !failed_.ok() || !p.status.ok() || aborting_ || !p.sends.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (!failed_.ok() || !p.status.ok() || aborting_) return;
        op = p.sends.front();
        ++busy_;
        p.writing = true;
      }
      const bool ok = WriteFrame(p.fd, op->tag, op->parts);
      const int error = errno;
      absl::MutexLock lock(&mu_);
      --busy_;
      p.writing = false;
      if (!ok) {
        return LostPeerLocked(
            peer, common::ErrnoStatus(absl::StatusCode::kUnavailable, absl::StrCat("writing to rank ", peer), error));
      }
      p.sends.pop_front();
      op->done = true;
    }
  }

  // Reads the rest of a "gave up" frame of `size` bytes from `peer`: why the peer gave up, as
  // UNAVAILABLE "rank <peer> gave up: <why>" (made safe to log and store: common/safe_text.h).
  // On a keyed connection a frame without its sender's MAC is refused (its text is not shown).
  absl::Status ReadGaveUp(int peer, uint64_t size) {
    const Peer& p = *peers_[peer];
    const size_t mac_bytes = p.session != nullptr ? kAbortMacBytes : 0;
    if (size > kMaxAbortReason + mac_bytes || size < mac_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("a \"gave up\" frame of ", size, " bytes"));
    }
    std::string frame(size, '\0');
    DQ_RETURN_IF_ERROR(Read(peer, reinterpret_cast<uint8_t*>(frame.data()), frame.size()));
    const absl::string_view reason = absl::string_view(frame).substr(0, size - mac_bytes);
    if (p.session != nullptr) {
      const common::HmacSha256::Digest mac = GaveUpMac(*p.session, peer, rank_, reason);
      if (CRYPTO_memcmp(mac.data(), frame.data() + reason.size(), mac.size()) != 0) {
        return absl::UnauthenticatedError("a \"gave up\" frame without its sender's MAC");
      }
    }
    return absl::UnavailableError(absl::StrCat("rank ", peer, " gave up: ", common::SafeText(reason)));
  }

  // Reads exactly `size` bytes from `peer` (a blocking socket: no deadline; Abort shuts it down).
  absl::Status Read(int peer, uint8_t* out, size_t size) {
    return common::ReadFull(peers_[peer]->fd, reinterpret_cast<char*>(out), size, absl::InfiniteFuture(),
                            absl::StrCat("reading from rank ", peer));
  }
  // The same into `parts`, in order (size <= their total).
  absl::Status Read(int peer, const Parts& parts, size_t size) {
    for (absl::Span<uint8_t> part : parts) {
      const size_t n = std::min(part.size(), size);
      if (n > 0) DQ_RETURN_IF_ERROR(Read(peer, part.data(), n));
      size -= n;
    }
    return absl::OkStatus();
  }

  // The connection to `peer` is closed or broken (`why`): what is still to come from or go to that
  // peer fails; the other peers carry on (a rank that finished its part may leave first; what it
  // sent before is still delivered).
  void LostPeer(int peer, const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    LostPeerLocked(peer, why);
  }
  void LostPeerLocked(int peer, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Peer& p = *peers_[peer];
    if (!p.status.ok()) return;
    p.status = absl::UnavailableError(absl::StrCat(Who(), ": connection to rank ", peer, " lost: ", why.message()));
    if (first_loss_.ok()) first_loss_ = p.status;
    shutdown(p.fd, SHUT_RDWR);
  }

  const int rank_, size_;
  const size_t max_early_bytes_;
  const size_t max_early_messages_;           // per peer
  std::vector<std::unique_ptr<Peer>> peers_;  // by rank; none for this rank
  absl::Mutex mu_;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  Handle next_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<Handle, std::unique_ptr<Op>> ops_ ABSL_GUARDED_BY(mu_);
  size_t early_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;             // threads inside a posted buffer
  absl::Status first_loss_ ABSL_GUARDED_BY(mu_);  // the first peer lost, if any
  bool aborting_ ABSL_GUARDED_BY(mu_) = false;    // Abort has begun: writers stop
};

// The transport's threads block in recv and sendmsg (Abort shuts the sockets down to free them).
void SetBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK); }

// Owns a socket until released.
struct Fd {
  explicit Fd(int f = -1) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  void reset(int f = -1) {
    common::CloseFd(fd);
    fd = f;
  }
  int release() { return std::exchange(fd, -1); }
  int fd;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> ConnectTcpTransport(Store& store, int rank, int size,
                                                               const TcpTransportOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("tcp transport: rank ", rank, " of a group of ", size));
  }
  if (options.hostname.empty()) return absl::InvalidArgumentError("tcp transport: no hostname to listen on");
  const absl::Time deadline = absl::Now() + options.timeout;
  // A backlog for strangers too: connections queue while the hellos are read.
  absl::StatusOr<int> listening = common::ListenOn(options.hostname, "0", std::max(size, 128));
  if (!listening.ok()) return common::Annotate(listening.status(), "tcp transport");
  Fd listener(*listening);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(listener.fd, reinterpret_cast<sockaddr*>(&bound), &len);
  // "host:port" (IPv6 hosts in brackets), as common::SplitHostPort reads it back.
  DQ_RETURN_IF_ERROR(store.Set(absl::StrCat("tcp/", rank), common::SockaddrString(bound)));

  auto transport = std::make_unique<TcpTransport>(rank, size, options.max_early_bytes, options.max_early_messages);
  // Lower ranks: connect and introduce ourselves (engine/tcp_hello.h).
  for (int q = 0; q < rank; ++q) {
    DQ_ASSIGN_OR_RETURN(const std::string address,
                        store.Get(absl::StrCat("tcp/", q), std::max(absl::ZeroDuration(), deadline - absl::Now())));
    DQ_ASSIGN_OR_RETURN(const auto host_port, common::SplitHostPort(address));
    DQ_ASSIGN_OR_RETURN(TcpLink link, DialPeer(host_port.first, host_port.second, rank, q, options.key, deadline));
    SetBlocking(link.fd);
    transport->AddPeer(std::move(link));
  }
  // Higher ranks: accepted concurrently, each introducing itself; anything else is turned away.
  // The wait ends early when the store's waits would (engine::InterruptibleStore: a peer that
  // failed the collective instead of joining, a view that changed).
  HelloAcceptor acceptor(listener.fd, rank, size, options.key, options.hello_timeout);
  DQ_ASSIGN_OR_RETURN(std::vector<TcpLink> links,
                      acceptor.AcceptAll(deadline, options.timeout, [&store] { return store.Interrupted(); }));
  for (TcpLink& link : links) {
    if (link.fd < 0) continue;
    common::SetNoDelay(link.fd);
    SetBlocking(link.fd);
    transport->AddPeer(std::move(link));
  }
  transport->Start();
  return std::unique_ptr<Transport>(std::move(transport));
}

}  // namespace dynamiq::engine
