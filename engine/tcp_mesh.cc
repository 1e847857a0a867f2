#include "engine/tcp_mesh.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/little_endian.h"
#include "common/safe_text.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "engine/tcp_frame.h"
#include "engine/tcp_hello.h"

namespace dynamiq::engine {
namespace {

using Session = TcpMeshSession;
using tcp_frame::Parts;

constexpr size_t kMaxGaveUpReason = 1024;
constexpr size_t kGaveUpMacBytes = common::HmacSha256::kBytes;
// What a message kept before its receive costs beyond its payload (its entry, queue and buffer
// headers): charged against max_early_bytes so that many tiny messages cannot grow the process
// without bound.
constexpr size_t kEarlyMessageCost = 1024;
// What Abort still sends of the messages posted to a peer (a step header that tells the peer why
// the collective failed), as far as the socket takes it without waiting.
constexpr size_t kAbortFlushBytes = size_t{64} << 10;
// How long Abort waits for writers to finish the message they are writing, and for the threads to
// leave the buffers its exchange posted, before it closes the connections they are busy on.
constexpr absl::Duration kAbortWait = absl::Milliseconds(200);
// "Gave up" frames kept for sessions this node has not reached yet, per connection.
constexpr size_t kMaxGaveUpsAhead = 16;

class View;

// A posted send or receive of a view.
struct Op {
  View* view;
  bool send;
  int peer;  // its index in the view
  uint64_t tag;
  Parts parts;
  size_t size = tcp_frame::TotalBytes(parts);
  bool done = false;
};

// A message kept before its receive. Shared: the reader fills it outside the lock while the
// connection's maps may move or drop it.
struct Early {
  explicit Early(size_t n) : bytes(n) {}
  std::vector<uint8_t> bytes;
  bool complete = false;  // its payload is read
};
using EarlyPtr = std::shared_ptr<Early>;

// What a connection's writer sends next: a posted send, or (op null) a fence.
struct Outgoing {
  Op* op = nullptr;
  Session fence;
};

// One connection to another node, and the view it serves now.
struct Link {
  int node = -1;
  int fd = -1;
  std::shared_ptr<const common::HmacSha256> session_key;  // keyed hellos: MACs "gave up" frames
  Session made;                                           // the session it was made for
  absl::Status status;                                    // not OK once closed or broken
  std::thread reader, writer;
  bool writing = false;            // the writer is inside the socket
  const Op* writing_op = nullptr;  // ... with this send (null: a fence)
  const Op* reading_op = nullptr;  // the reader is filling this posted receive
  std::deque<Outgoing> sends;      // in posting order; the front is being written
  // The view it serves (null between views), the peer's index there, and the newest session
  // attached here (messages of earlier ones are dropped).
  View* view = nullptr;
  int index = -1;
  Session floor;
  Session peer_session;                            // what the peer's messages belong to: its last fence, or `made`
  std::map<uint64_t, std::deque<Op*>> recvs;       // the view's, per tag, in posting order
  std::map<uint64_t, std::deque<EarlyPtr>> early;  // the view's, per tag, in arrival order
  std::map<Session, std::vector<std::pair<uint64_t, EarlyPtr>>> ahead;  // of later sessions
  std::map<Session, std::string> gave_up_ahead;                         // ... and why the peer gave up there
  size_t early_messages = 0;                                            // in early and ahead
};

class View final : public Transport {
 public:
  View(std::shared_ptr<TcpMesh::Impl> mesh, int rank, std::vector<int> members, Session session)
      : mesh_(std::move(mesh)), rank_(rank), members_(std::move(members)), session_(session) {
    links.assign(members_.size(), nullptr);
    peer_status.resize(members_.size());
  }
  ~View() override;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::string name() const override { return "tcp"; }
  bool SupportsParts() const override { return true; }
  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override {
    return PostSendParts(peer, tag, {data});
  }
  absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override {
    return PostRecvParts(peer, tag, {buffer});
  }
  absl::StatusOr<Handle> PostSendParts(int peer, uint64_t tag,
                                       absl::Span<const absl::Span<const uint8_t>> parts) override;
  absl::StatusOr<Handle> PostRecvParts(int peer, uint64_t tag, absl::Span<const absl::Span<uint8_t>> parts) override;
  absl::Status Wait(Handle handle, absl::Time deadline) override;
  void Abort() override;

  std::string Who() const { return absl::StrCat("tcp transport rank ", rank_); }
  Session session() const { return session_; }

  // Guarded by the mesh's mutex.
  std::vector<Link*> links;  // by index; null for this rank, and once detached
  absl::Status failed;       // every pending and later Wait fails with it
  bool aborting = false;     // writers start none of its sends
  bool detached = false;     // its connections serve it no more
  std::vector<absl::Status> peer_status;
  absl::Status first_loss;  // the first peer lost, if any
  std::map<Handle, std::unique_ptr<Op>> ops;
  Handle next = 1;

 private:
  const std::shared_ptr<TcpMesh::Impl> mesh_;
  const int rank_;
  const std::vector<int> members_;
  const Session session_;
};

// Owns a socket until released.
struct Fd {
  explicit Fd(int f = -1) : fd(f) {}
  Fd(Fd&& other) noexcept : fd(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    reset(other.release());
    return *this;
  }
  ~Fd() { reset(); }
  void reset(int f = -1) {
    common::CloseFd(fd);
    fd = f;
  }
  int release() { return std::exchange(fd, -1); }
  int fd;
};

// The transport's threads block in recv and sendmsg (closing shuts the sockets down to free them).
void SetBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK); }

// A member's record of the connections it holds intact ("mesh/<rank>"): per node
// "<node>:<made epoch>.<made sequence>:<floor epoch>.<floor sequence>", separated by ';'.
struct Held {
  Session made, floor;
};
std::string SessionText(Session s) { return absl::StrCat(s.epoch, ".", s.sequence); }
bool ParseSession(absl::string_view text, Session* s) {
  std::vector<absl::string_view> f = absl::StrSplit(text, '.');
  return f.size() == 2 && absl::SimpleAtoi(f[0], &s->epoch) && absl::SimpleAtoi(f[1], &s->sequence);
}
// What `record` says of the connection to `node` (nothing for a record that does not parse: a
// connection is kept only when both ends say so).
std::optional<Held> HeldTo(absl::string_view record, int node) {
  for (absl::string_view entry : absl::StrSplit(record, ';', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(entry, ':');
    int n = -1;
    Held held;
    if (f.size() == 3 && absl::SimpleAtoi(f[0], &n) && n == node && ParseSession(f[1], &held.made) &&
        ParseSession(f[2], &held.floor)) {
      return held;
    }
  }
  return std::nullopt;
}

// Whether the connection is not waiting out a retransmission timeout. One that went through a cut
// link (or towards a peer that vanished) backs its timer off and, once the link is back, takes
// seconds to move again, where a new connection starts at once: it is not kept for the next view.
// (Unacknowledged bytes alone say nothing: the receiver may delay its ACK by tens of milliseconds.)
bool Settled(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return false;
  return info.tcpi_retransmits == 0 && info.tcpi_backoff == 0 && info.tcpi_ca_state != TCP_CA_Loss;
}

absl::Status ReadExactly(int fd, uint8_t* out, size_t size, int node) {
  return common::ReadFull(fd, reinterpret_cast<char*>(out), size, absl::InfiniteFuture(),
                          absl::StrCat("reading from node ", node));
}

}  // namespace

class TcpMesh::Impl : public std::enable_shared_from_this<TcpMesh::Impl> {
 public:
  Impl(int node, int num_nodes, TcpTransportOptions options, bool keep)
      : node_(node), num_nodes_(num_nodes), options_(std::move(options)), keep_(keep), links_(num_nodes) {}

  ~Impl() {
    std::vector<std::unique_ptr<Link>> all;
    {
      absl::MutexLock lock(&mu_);
      closing_ = true;
      for (auto& l : links_) {
        if (l == nullptr) continue;
        shutdown(l->fd, SHUT_RDWR);
        all.push_back(std::move(l));
      }
    }
    Join(all);
  }

  absl::StatusOr<std::unique_ptr<Transport>> Connect(Store& store, const std::vector<int>& members, Session session);

  absl::StatusOr<Transport::Handle> Post(View& v, bool send, int peer, uint64_t tag, Parts parts) {
    if (peer < 0 || peer >= v.size() || peer == v.rank()) {
      return absl::InvalidArgumentError(absl::StrCat(v.Who(), ": no peer ", peer, " in a group of ", v.size()));
    }
    if (send && (tag == tcp_frame::kGaveUpTag || tag == tcp_frame::kFenceTag)) {
      return absl::InvalidArgumentError(absl::StrCat(v.Who(), ": tag ", tag, " is reserved"));
    }
    absl::MutexLock lock(&mu_);
    DQ_RETURN_IF_ERROR(v.failed);
    // A peer already lost fails the operation at its Wait, not here: what the peer sent before it
    // left (a bad header, say: the first error) is still delivered, and the caller that waits for
    // it first reports that, whatever order it posted in.
    const Transport::Handle h = v.next++;
    Op& op = *(v.ops[h] = std::make_unique<Op>(Op{&v, send, peer, tag, std::move(parts)}));
    Link& l = *v.links[peer];
    if (send) {
      l.sends.push_back({&op, {}});
    } else {
      l.recvs[tag].push_back(&op);
      DeliverEarly(l, tag);
    }
    return h;
  }

  absl::Status Wait(View& v, Transport::Handle handle, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto it = v.ops.find(handle);
    if (it == v.ops.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(v.Who(), ": Wait on unknown handle ", handle, " (never posted or already waited)"));
    }
    Op* op = it->second.get();
    // A send the writer is still inside completes, or fails, there: the peer may have read it,
    // finished its part of the collective and left in the moment before the writer marks it done.
    auto finished = [&v, op]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (op->done || !v.failed.ok()) return true;
      const Link* l = v.links[op->peer];
      return !v.peer_status[op->peer].ok() && !(op->send && l != nullptr && l->writing_op == op);
    };
    mu_.AwaitWithDeadline(absl::Condition(&finished), deadline);
    if (op->done) {
      v.ops.erase(it);
      return absl::OkStatus();
    }
    if (!v.failed.ok()) return v.failed;
    if (!v.peer_status[op->peer].ok()) return v.peer_status[op->peer];
    return absl::DeadlineExceededError(absl::StrCat(v.Who(), ": ", op->send ? "send to" : "receive from", " rank ",
                                                    op->peer, " (tag ", op->tag, ") did not complete in time"));
  }

  // Ends `v`'s exchange (see the header), then detaches it from its connections.
  void Abort(View& v) {
    absl::MutexLock lock(&mu_);
    if (v.detached) return;
    const absl::Time until = absl::Now() + kAbortWait;
    if (v.failed.ok()) {
      // Writers finish the message they are writing (briefly: a peer that reads nothing must not
      // hold Abort up) and start none of this view's. A second Abort meanwhile waits too; whichever
      // wakes first flushes and fails the view.
      v.aborting = true;
      auto quiet = [&v]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        for (const Link* l : v.links) {
          if (l != nullptr && l->writing) return false;
        }
        return true;
      };
      mu_.AwaitWithDeadline(absl::Condition(&quiet), until);
    }
    if (v.failed.ok()) {
      const std::string why = std::string(
          (!v.first_loss.ok() ? v.first_loss : absl::AbortedError(absl::StrCat(v.Who(), ": transport aborted")))
              .message()
              .substr(0, kMaxGaveUpReason));
      for (Link* l : v.links) {
        if (l != nullptr && l->status.ok()) Flush(*l, v, why);
      }
      v.failed = absl::AbortedError(absl::StrCat(v.Who(), ": transport aborted"));
    }
    if (!keep_) {
      for (Link* l : v.links) {
        if (l != nullptr) BreakLink(*l, v.failed);
      }
    }
    // Until every thread is out of the buffers the callers posted (they may free them next): one
    // still inside when the wait is over has its connection closed, which frees it.
    auto out = [&v]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const Link* l : v.links) {
        if (l == nullptr) continue;
        if ((l->reading_op != nullptr && l->reading_op->view == &v) ||
            (l->writing_op != nullptr && l->writing_op->view == &v)) {
          return false;
        }
      }
      return true;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&out), until)) {
      for (Link* l : v.links) {
        if (l != nullptr && ((l->reading_op != nullptr && l->reading_op->view == &v) ||
                             (l->writing_op != nullptr && l->writing_op->view == &v))) {
          BreakLink(*l, absl::AbortedError("a message of an aborted exchange was still on the wire"));
        }
      }
      mu_.Await(absl::Condition(&out));
    }
    Detach(v);
  }

  Counts counts() const {
    absl::MutexLock lock(&mu_);
    return counts_;
  }

 private:
  // Before the view lets its connection to a peer go: what was posted to the peer that the socket
  // takes without waiting (up to kAbortFlushBytes: a step header saying this rank runs a different
  // collective reaches the peer, which then names the mismatch itself), then a frame saying why
  // this rank gave up (a peer lost first, say), which the peer's error carries. A connection that
  // cannot take the frame now is closed: the peer learns from that at once instead.
  void Flush(Link& l, View& v, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (l.writing) return BreakLink(l, absl::AbortedError("aborted while writing"));
    size_t budget = kAbortFlushBytes;
    while (!l.sends.empty()) {
      const Outgoing out = l.sends.front();
      const size_t size = out.op != nullptr ? out.op->size : tcp_frame::kFenceBytes;
      if (size > budget) break;
      uint8_t fence[tcp_frame::kFenceBytes];
      const tcp_frame::WriteNowResult written =
          out.op != nullptr ? tcp_frame::WriteNow(l.fd, out.op->tag, out.op->parts)
                            : tcp_frame::WriteNow(l.fd, tcp_frame::kFenceTag, FenceParts(out.fence, fence));
      if (written != tcp_frame::WriteNowResult::kAll) {
        if (written == tcp_frame::WriteNowResult::kPart) return BreakLink(l, absl::AbortedError("aborted mid-message"));
        break;
      }
      budget -= size;
      l.sends.pop_front();
    }
    // What did not go is dropped (none of it started: the connection is still framed); a fence
    // still queued would have to go before the frame that says why.
    std::erase_if(l.sends, [&v](const Outgoing& o) { return o.op != nullptr && o.op->view == &v; });
    const bool fenced = std::none_of(l.sends.begin(), l.sends.end(), [](const Outgoing& o) { return o.op == nullptr; });
    std::string reason = why;
    if (l.session_key != nullptr) {
      const common::HmacSha256::Digest mac = GaveUpMac(*l.session_key, node_, l.node, why);
      reason.append(reinterpret_cast<const char*>(mac.data()), mac.size());
    }
    if (!fenced || tcp_frame::WriteNow(l.fd, tcp_frame::kGaveUpTag,
                                       {absl::MakeSpan(reinterpret_cast<uint8_t*>(reason.data()), reason.size())}) !=
                       tcp_frame::WriteNowResult::kAll) {
      BreakLink(l, absl::AbortedError("could not say why this rank gave up"));
    }
  }

  static Parts FenceParts(Session s, uint8_t (&bytes)[tcp_frame::kFenceBytes]) {
    common::PutLe<uint64_t>(bytes, s.epoch);
    common::PutLe<uint64_t>(bytes + 8, s.sequence);
    return {absl::MakeSpan(bytes)};
  }

  // The view's connections serve it no more: its sends still queued, receives and early messages go.
  void Detach(View& v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (v.detached) return;
    v.detached = true;
    for (Link*& l : v.links) {
      if (l != nullptr && l->view == &v) {
        std::erase_if(l->sends, [&v](const Outgoing& o) { return o.op != nullptr && o.op->view == &v; });
        l->recvs.clear();
        for (auto& [tag, kept] : l->early) {
          for (const EarlyPtr& e : kept) Refund(*l, e->bytes.size());
        }
        l->early.clear();
        l->view = nullptr;
      }
      l = nullptr;
    }
    if (attached_ == &v) attached_ = nullptr;
  }

  // `l` serves `v` (at index q) from now on: a kept connection first fences off the sessions before.
  void Attach(Link& l, View& v, int q, bool kept) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    l.view = &v;
    l.index = q;
    if (kept) {
      l.floor = v.session();
      l.sends.push_back({nullptr, v.session()});
      for (auto it = l.ahead.begin(); it != l.ahead.end();) {
        if (it->first > v.session()) break;
        for (auto& [tag, e] : it->second) {
          if (it->first == v.session()) {
            l.early[tag].push_back(std::move(e));
          } else {
            Refund(l, e->bytes.size());
          }
        }
        it = l.ahead.erase(it);
      }
      if (auto g = l.gave_up_ahead.find(v.session()); g != l.gave_up_ahead.end()) {
        LostPeer(v, q, absl::UnavailableError(absl::StrCat(v.Who(), ": rank ", q, " gave up: ", g->second)));
      }
      l.gave_up_ahead.erase(l.gave_up_ahead.begin(), l.gave_up_ahead.upper_bound(v.session()));
    }
    if (!l.status.ok()) {
      LostPeer(
          v, q,
          absl::UnavailableError(absl::StrCat(v.Who(), ": connection to rank ", q, " lost: ", l.status.message())));
    }
  }

  void LostPeer(View& v, int q, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!v.peer_status[q].ok()) return;
    if (v.first_loss.ok()) v.first_loss = status;
    v.peer_status[q] = std::move(status);
  }

  // The connection is closed or broken (`why`): what its view still has pending with that peer
  // fails; the other peers carry on (a rank that finished its part may leave first; what it sent
  // before is still delivered). The next view connects the pair again.
  void BreakLink(Link& l, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!l.status.ok()) return;
    l.status = absl::UnavailableError(absl::StrCat("connection to node ", l.node, " lost: ", why.message()));
    shutdown(l.fd, SHUT_RDWR);
    if (l.view != nullptr) {
      LostPeer(*l.view, l.index,
               absl::UnavailableError(
                   absl::StrCat(l.view->Who(), ": connection to rank ", l.index, " lost: ", why.message())));
    }
  }

  // A peer's message does not fit what `v` posted: the view fails, and the connection, whose peer
  // broke the protocol, closes.
  void FailView(View& v, absl::Status status, Link& culprit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (v.failed.ok()) v.failed = status;
    BreakLink(culprit, status);
    if (!keep_) {
      for (Link* l : v.links) {
        if (l != nullptr) BreakLink(*l, status);
      }
    }
  }

  bool Fits(const Link& l, size_t size) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t left = options_.max_early_bytes - early_bytes_;
    return size <= left && left - size >= kEarlyMessageCost && l.early_messages < options_.max_early_messages;
  }
  EarlyPtr Charge(Link& l, size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    early_bytes_ += size + kEarlyMessageCost;
    ++l.early_messages;
    return std::make_shared<Early>(size);
  }
  void Refund(Link& l, size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    early_bytes_ -= size + kEarlyMessageCost;
    --l.early_messages;
  }

  // Hands complete early messages of `tag` to receives posted for it, in order.
  void DeliverEarly(Link& l, uint64_t tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (l.view == nullptr) return;
    auto e = l.early.find(tag);
    auto r = l.recvs.find(tag);
    while (e != l.early.end() && !e->second.empty() && e->second.front()->complete && r != l.recvs.end() &&
           !r->second.empty()) {
      const EarlyPtr m = e->second.front();
      Op* op = r->second.front();
      if (m->bytes.size() > op->size) {
        return FailView(*l.view,
                        absl::InvalidArgumentError(absl::StrCat(l.view->Who(), ": a message of ", m->bytes.size(),
                                                                " bytes from rank ", l.index, " (tag ", tag,
                                                                ") for a receive of ", op->size, " bytes")),
                        l);
      }
      tcp_frame::Scatter(m->bytes, op->parts);
      Refund(l, m->bytes.size());
      op->done = true;
      e->second.pop_front();
      r->second.pop_front();
    }
    if (e != l.early.end() && e->second.empty()) l.early.erase(e);
    if (r != l.recvs.end() && r->second.empty()) l.recvs.erase(r);
  }

  void ReadLoop(Link& l);
  void WriteLoop(Link& l);
  absl::StatusOr<std::string> ReadGaveUp(Link& l, uint64_t size);

  static void Join(std::vector<std::unique_ptr<Link>>& links) {
    for (auto& l : links) {
      if (l->reader.joinable()) l->reader.join();
      if (l->writer.joinable()) l->writer.join();
      common::CloseFd(l->fd);
    }
    links.clear();
  }

  const int node_, num_nodes_;
  const TcpTransportOptions options_;
  const bool keep_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Link>> links_ ABSL_GUARDED_BY(mu_);  // by node; none for this one
  View* attached_ ABSL_GUARDED_BY(mu_) = nullptr;                  // the view its connections serve
  size_t early_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  Counts counts_ ABSL_GUARDED_BY(mu_);
};

void TcpMesh::Impl::ReadLoop(Link& l) {
  uint8_t frame[tcp_frame::kFrameBytes];
  std::vector<uint8_t> scratch;
  while (true) {
    if (absl::Status read = ReadExactly(l.fd, frame, sizeof(frame), l.node); !read.ok()) {
      absl::MutexLock lock(&mu_);
      return BreakLink(l, read);
    }
    const uint64_t tag = common::GetLe<uint64_t>(frame), size = common::GetLe<uint64_t>(frame + 8);
    if (tag == tcp_frame::kGaveUpTag) {
      absl::StatusOr<std::string> why = ReadGaveUp(l, size);
      absl::MutexLock lock(&mu_);
      if (!why.ok()) return BreakLink(l, why.status());
      if (!keep_) return BreakLink(l, absl::UnavailableError(absl::StrCat("rank ", l.index, " gave up: ", *why)));
      const Session f = l.peer_session;
      if (l.view != nullptr && f == l.view->session()) {
        LostPeer(*l.view, l.index,
                 absl::UnavailableError(absl::StrCat(l.view->Who(), ": rank ", l.index, " gave up: ", *why)));
      } else if (f > l.floor) {
        l.gave_up_ahead[f] = *std::move(why);
        if (l.gave_up_ahead.size() > kMaxGaveUpsAhead) l.gave_up_ahead.erase(l.gave_up_ahead.begin());
      }
      continue;
    }
    if (tag == tcp_frame::kFenceTag) {
      uint8_t bytes[tcp_frame::kFenceBytes];
      absl::Status read = size == sizeof(bytes)
                              ? ReadExactly(l.fd, bytes, sizeof(bytes), l.node)
                              : absl::InvalidArgumentError(absl::StrCat("a fence frame of ", size, " bytes"));
      absl::MutexLock lock(&mu_);
      if (!read.ok()) return BreakLink(l, read);
      const Session s{common::GetLe<uint64_t>(bytes), common::GetLe<uint64_t>(bytes + 8)};
      if (s < l.peer_session) return BreakLink(l, absl::InvalidArgumentError("a fence back to an earlier session"));
      l.peer_session = s;
      continue;
    }
    enum class Where { kPosted, kEarly, kAhead, kDrop };
    Op* op = nullptr;
    EarlyPtr early;
    {
      absl::MutexLock lock(&mu_);
      // Straight into a posted receive of the view when nothing of this tag is waiting before it;
      // otherwise kept, as long as the early bytes fit (else the peer waits for the receive to be
      // posted); a later session's message kept for its view; an earlier session's dropped.
      auto where = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (l.view != nullptr && l.peer_session == l.view->session()) {
          if (!l.view->failed.ok()) return Where::kDrop;
          auto r = l.recvs.find(tag);
          return r != l.recvs.end() && !r->second.empty() && l.early.count(tag) == 0 ? Where::kPosted : Where::kEarly;
        }
        return l.peer_session > l.floor ? Where::kAhead : Where::kDrop;
      };
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (closing_ || !l.status.ok()) return true;
        const Where w = where();
        return w == Where::kPosted || w == Where::kDrop || Fits(l, size);
      };
      mu_.Await(absl::Condition(&ready));
      if (closing_ || !l.status.ok()) return;
      switch (where()) {
        case Where::kPosted: {
          auto r = l.recvs.find(tag);
          op = r->second.front();
          if (size > op->size) {
            return FailView(*l.view,
                            absl::InvalidArgumentError(absl::StrCat(l.view->Who(), ": a message of ", size,
                                                                    " bytes from rank ", l.index, " (tag ", tag,
                                                                    ") for a receive of ", op->size, " bytes")),
                            l);
          }
          r->second.pop_front();
          if (r->second.empty()) l.recvs.erase(r);
          l.reading_op = op;
          break;
        }
        case Where::kEarly:
          early = Charge(l, size);
          l.early[tag].push_back(early);
          break;
        case Where::kAhead:
          early = Charge(l, size);
          l.ahead[l.peer_session].emplace_back(tag, early);
          break;
        case Where::kDrop:
          break;
      }
    }
    absl::Status read;
    if (op != nullptr) {
      size_t left = size;
      for (absl::Span<uint8_t> part : op->parts) {
        const size_t n = std::min(part.size(), left);
        if (n > 0 && !(read = ReadExactly(l.fd, part.data(), n, l.node)).ok()) break;
        left -= n;
      }
    } else if (early != nullptr) {
      read = ReadExactly(l.fd, early->bytes.data(), size, l.node);
    } else {
      scratch.resize(std::min<size_t>(size, size_t{64} << 10));
      for (uint64_t left = size; left > 0 && read.ok();) {
        const size_t n = std::min<uint64_t>(left, scratch.size());
        read = ReadExactly(l.fd, scratch.data(), n, l.node);
        left -= n;
      }
    }
    absl::MutexLock lock(&mu_);
    l.reading_op = nullptr;
    if (!read.ok()) return BreakLink(l, read);
    if (op != nullptr) {
      op->done = true;
    } else if (early != nullptr) {
      early->complete = true;
      DeliverEarly(l, tag);
    }
  }
}

void TcpMesh::Impl::WriteLoop(Link& l) {
  while (true) {
    Outgoing out;
    {
      absl::MutexLock lock(&mu_);
      // A send of a view that is aborting or failed waits (Abort flushes or drops it).
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (closing_ || !l.status.ok()) return true;
        if (l.sends.empty()) return false;
        const Op* op = l.sends.front().op;
        return op == nullptr || (!op->view->aborting && op->view->failed.ok());
      };
      mu_.Await(absl::Condition(&ready));
      if (closing_ || !l.status.ok()) return;
      out = l.sends.front();
      l.writing = true;
      l.writing_op = out.op;
    }
    uint8_t fence[tcp_frame::kFenceBytes];
    const bool ok = out.op != nullptr ? tcp_frame::Write(l.fd, out.op->tag, out.op->parts)
                                      : tcp_frame::Write(l.fd, tcp_frame::kFenceTag, FenceParts(out.fence, fence));
    const int error = errno;
    absl::MutexLock lock(&mu_);
    l.writing = false;
    l.writing_op = nullptr;
    if (!ok) {
      return BreakLink(
          l, common::ErrnoStatus(absl::StatusCode::kUnavailable, absl::StrCat("writing to node ", l.node), error));
    }
    l.sends.pop_front();
    if (out.op != nullptr) out.op->done = true;
  }
}

// Reads the rest of a "gave up" frame of `size` bytes: why the peer gave up, made safe to log and
// store (common/safe_text.h). On a keyed connection a frame without its sender's MAC is refused.
absl::StatusOr<std::string> TcpMesh::Impl::ReadGaveUp(Link& l, uint64_t size) {
  const size_t mac_bytes = l.session_key != nullptr ? kGaveUpMacBytes : 0;
  if (size > kMaxGaveUpReason + mac_bytes || size < mac_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a \"gave up\" frame of ", size, " bytes"));
  }
  std::string frame(size, '\0');
  DQ_RETURN_IF_ERROR(ReadExactly(l.fd, reinterpret_cast<uint8_t*>(frame.data()), frame.size(), l.node));
  const absl::string_view reason = absl::string_view(frame).substr(0, size - mac_bytes);
  if (l.session_key != nullptr) {
    const common::HmacSha256::Digest mac = GaveUpMac(*l.session_key, l.node, node_, reason);
    if (CRYPTO_memcmp(mac.data(), frame.data() + reason.size(), mac.size()) != 0) {
      return absl::UnauthenticatedError("a \"gave up\" frame without its sender's MAC");
    }
  }
  return common::SafeText(reason);
}

absl::StatusOr<std::unique_ptr<Transport>> TcpMesh::Impl::Connect(Store& store, const std::vector<int>& members,
                                                                  Session session) {
  const int size = static_cast<int>(members.size());
  int me = -1;
  for (int i = 0; i < size; ++i) {
    if (members[i] < 0 || members[i] >= num_nodes_ || (i > 0 && members[i] <= members[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("tcp mesh: members must be ascending node ids below ", num_nodes_));
    }
    if (members[i] == node_) me = i;
  }
  if (me < 0) return absl::InvalidArgumentError(absl::StrCat("tcp mesh: node ", node_, " is not a member"));
  if (options_.hostname.empty()) return absl::InvalidArgumentError("tcp transport: no hostname to listen on");
  {
    absl::MutexLock lock(&mu_);
    if (attached_ != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("tcp mesh of node ", node_, ": the transport of session ",
                                                        SessionText(attached_->session()), " is still there"));
    }
  }
  const absl::Time deadline = absl::Now() + options_.timeout;
  auto remaining = [deadline] { return std::max(absl::ZeroDuration(), deadline - absl::Now()); };
  // A backlog for strangers too: connections queue while the hellos are read.
  absl::StatusOr<int> listening = common::ListenOn(options_.hostname, "0", std::max(size, 128));
  if (!listening.ok()) return common::Annotate(listening.status(), "tcp transport");
  Fd listener(*listening);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(listener.fd, reinterpret_cast<sockaddr*>(&bound), &len);
  // "host:port" (IPv6 hosts in brackets), as common::SplitHostPort reads it back.
  DQ_RETURN_IF_ERROR(store.Set(absl::StrCat("tcp/", me), common::SockaddrString(bound)));

  // Which connections each end holds intact, published so that both ends of a pair decide alike.
  std::vector<std::optional<Held>> mine(size);
  std::string record;
  {
    absl::MutexLock lock(&mu_);
    for (int q = 0; q < size; ++q) {
      const Link* l = q == me ? nullptr : links_[members[q]].get();
      if (l == nullptr || !l->status.ok() || !Settled(l->fd)) continue;
      mine[q] = Held{l->made, l->floor};
      absl::StrAppend(&record, members[q], ":", SessionText(l->made), ":", SessionText(l->floor), ";");
    }
  }
  DQ_RETURN_IF_ERROR(store.Set(absl::StrCat("mesh/", me), record));
  std::vector<bool> keep(size, false);
  for (int q = 0; q < size; ++q) {
    if (!mine[q].has_value()) continue;
    DQ_ASSIGN_OR_RETURN(const std::string theirs, store.Get(absl::StrCat("mesh/", q), remaining()));
    const std::optional<Held> held = HeldTo(theirs, node_);
    keep[q] = held.has_value() && held->made == mine[q]->made && session > mine[q]->floor && session > held->floor;
  }
  std::vector<std::unique_ptr<Link>> retired;
  {
    absl::MutexLock lock(&mu_);
    for (int q = 0; q < size; ++q) {
      std::unique_ptr<Link>& l = links_[members[q]];
      if (q == me || keep[q] || l == nullptr) continue;
      BreakLink(*l, absl::CancelledError("replaced by a new connection"));
      for (auto& [later, kept] : l->ahead) {
        for (auto& [tag, e] : kept) Refund(*l, e->bytes.size());
      }
      l->ahead.clear();
      retired.push_back(std::move(l));
    }
  }
  Join(retired);

  // Lower ranks: connect and introduce ourselves (engine/tcp_hello.h). Higher ranks: accepted
  // concurrently, each introducing itself; anything else is turned away. The wait ends early when
  // the store's waits would (engine::InterruptibleStore: a peer that failed the collective
  // instead of joining, a view that changed).
  std::vector<TcpLink> made(size);
  std::vector<Fd> made_fds(size);
  for (int q = 0; q < me; ++q) {
    if (keep[q]) continue;
    DQ_ASSIGN_OR_RETURN(const std::string address, store.Get(absl::StrCat("tcp/", q), remaining()));
    DQ_ASSIGN_OR_RETURN(const auto host_port, common::SplitHostPort(address));
    DQ_ASSIGN_OR_RETURN(made[q], DialPeer(host_port.first, host_port.second, me, q, options_.key, deadline));
    made_fds[q].reset(made[q].fd);
    SetBlocking(made[q].fd);
  }
  std::vector<bool> wanted(size, false);
  for (int q = me + 1; q < size; ++q) wanted[q] = !keep[q];
  if (std::find(wanted.begin(), wanted.end(), true) != wanted.end()) {
    HelloAcceptor acceptor(listener.fd, me, size, options_.key, options_.hello_timeout, wanted);
    DQ_ASSIGN_OR_RETURN(std::vector<TcpLink> accepted,
                        acceptor.AcceptAll(deadline, options_.timeout, [&store] { return store.Interrupted(); }));
    for (int q = me + 1; q < size; ++q) {
      if (accepted[q].fd < 0) continue;
      made[q] = std::move(accepted[q]);
      made_fds[q].reset(made[q].fd);
      common::SetNoDelay(made[q].fd);
      SetBlocking(made[q].fd);
    }
  }

  auto view = std::make_unique<View>(shared_from_this(), me, members, session);
  std::vector<Link*> start;
  {
    absl::MutexLock lock(&mu_);
    for (int q = 0; q < size; ++q) {
      if (q == me) continue;
      if (!keep[q]) {
        auto l = std::make_unique<Link>();
        l->node = members[q];
        l->fd = made_fds[q].release();
        l->session_key = std::move(made[q].session);
        l->made = l->floor = l->peer_session = session;
        start.push_back(l.get());
        links_[members[q]] = std::move(l);
        ++counts_.made;
      } else {
        ++counts_.kept;
      }
      view->links[q] = links_[members[q]].get();
      Attach(*view->links[q], *view, q, keep[q]);
    }
    attached_ = view.get();
  }
  for (Link* l : start) {
    l->reader = std::thread([this, l] { ReadLoop(*l); });
    l->writer = std::thread([this, l] { WriteLoop(*l); });
  }
  return std::unique_ptr<Transport>(std::move(view));
}

View::~View() { mesh_->Abort(*this); }

absl::StatusOr<Transport::Handle> View::PostSendParts(int peer, uint64_t tag,
                                                      absl::Span<const absl::Span<const uint8_t>> parts) {
  Parts writable;  // never written: sends only read their parts
  for (absl::Span<const uint8_t> part : parts) writable.emplace_back(const_cast<uint8_t*>(part.data()), part.size());
  return mesh_->Post(*this, true, peer, tag, std::move(writable));
}

absl::StatusOr<Transport::Handle> View::PostRecvParts(int peer, uint64_t tag,
                                                      absl::Span<const absl::Span<uint8_t>> parts) {
  return mesh_->Post(*this, false, peer, tag, Parts(parts.begin(), parts.end()));
}

absl::Status View::Wait(Handle handle, absl::Time deadline) { return mesh_->Wait(*this, handle, deadline); }

void View::Abort() { mesh_->Abort(*this); }

TcpMesh::TcpMesh(int node, int num_nodes, TcpTransportOptions options, bool keep_connections)
    : impl_(std::make_shared<Impl>(node, num_nodes, std::move(options), keep_connections)) {}

TcpMesh::~TcpMesh() = default;

absl::StatusOr<std::unique_ptr<Transport>> TcpMesh::Connect(Store& store, const std::vector<int>& members,
                                                            TcpMeshSession session) {
  return impl_->Connect(store, members, session);
}

TcpMesh::Counts TcpMesh::counts() const { return impl_->counts(); }

}  // namespace dynamiq::engine
