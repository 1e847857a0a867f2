// The internals of engine/tcp_mesh.h, shared by its three sources: tcp_mesh.cc (connecting a
// view: which connections are kept, which made), tcp_mesh_view.cc (a view's operations, its abort
// and detach) and tcp_mesh_link.cc (a connection's reader and writer). Not an interface: include
// engine/tcp_mesh.h.
#ifndef DQ_ENGINE_TCP_MESH_IMPL_H_
#define DQ_ENGINE_TCP_MESH_IMPL_H_

#include <stddef.h>
#include <stdint.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/hmac.h"
#include "engine/tcp_frame.h"
#include "engine/tcp_mesh.h"

namespace dynamiq::engine {
namespace tcp_mesh_internal {

using Session = TcpMeshSession;
using Parts = tcp_frame::Parts;

inline constexpr size_t kMaxGaveUpReason = 1024;
inline constexpr size_t kGaveUpMacBytes = common::HmacSha256::kBytes;
// What a message kept before its receive costs beyond its payload (its entry, queue and buffer
// headers): charged against max_early_bytes so that many tiny messages cannot grow the process
// without bound.
inline constexpr size_t kEarlyMessageCost = 1024;
// What Abort still sends of the messages posted to a peer (a step header that tells the peer why
// the collective failed), as far as the socket takes it without waiting.
inline constexpr size_t kAbortFlushBytes = size_t{64} << 10;
// How long Abort waits for writers to finish the message they are writing, and for the threads to
// leave the buffers its exchange posted, before it closes the connections they are busy on.
inline constexpr absl::Duration kAbortWait = absl::Milliseconds(200);
// "Gave up" frames kept for sessions this node has not reached yet, per connection.
inline constexpr size_t kMaxGaveUpsAhead = 16;

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
  bool told = false;         // Abort sent its peers why it gave up
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

}  // namespace tcp_mesh_internal

class TcpMesh::Impl : public std::enable_shared_from_this<TcpMesh::Impl> {
 public:
  using Session = TcpMeshSession;
  using Parts = tcp_frame::Parts;
  using Link = tcp_mesh_internal::Link;
  using View = tcp_mesh_internal::View;
  using EarlyPtr = tcp_mesh_internal::EarlyPtr;

  Impl(int node, int num_nodes, TcpTransportOptions options, bool keep)
      : node_(node), num_nodes_(num_nodes), options_(std::move(options)), keep_(keep), links_(num_nodes) {}

  ~Impl();

  absl::StatusOr<std::unique_ptr<Transport>> Connect(Store& store, const std::vector<int>& members, Session session);

  absl::StatusOr<Transport::Handle> Post(View& v, bool send, int peer, uint64_t tag, Parts parts);

  absl::Status Wait(View& v, Transport::Handle handle, absl::Time deadline);

  // Ends `v`'s exchange (see the header), then detaches it from its connections.
  void Abort(View& v);

  Counts counts() const;

 private:
  // Before the view lets its connection to a peer go: what was posted to the peer that the socket
  // takes without waiting (up to kAbortFlushBytes: a step header saying this rank runs a different
  // collective reaches the peer, which then names the mismatch itself), then a frame saying why
  // this rank gave up (a peer lost first, say), which the peer's error carries. A connection that
  // cannot take the frame now is closed: the peer learns from that at once instead.
  void Flush(Link& l, View& v, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  static Parts FenceParts(Session s, uint8_t (&bytes)[tcp_frame::kFenceBytes]);

  // The view's connections serve it no more: its sends still queued, receives and early messages go.
  void Detach(View& v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // `l` serves `v` (at index q) from now on: a kept connection first fences off the sessions before.
  void Attach(Link& l, View& v, int q, bool kept) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // `v` lost its peer `q` (UNAVAILABLE `status`); the first loss is what its abort tells the others.
  void LostPeer(View& v, int q, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The connection is closed or broken (`why`): what its view still has pending with that peer
  // fails; the other peers carry on (a rank that finished its part may leave first; what it sent
  // before is still delivered). The next view connects the pair again.
  void BreakLink(Link& l, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A peer's message does not fit what `v` posted: the view fails, and the connection, whose peer
  // broke the protocol, closes.
  void FailView(View& v, absl::Status status, Link& culprit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The early-message budget (max_early_bytes for the mesh, max_early_messages per connection).
  bool Fits(const Link& l, size_t size) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  EarlyPtr Charge(Link& l, size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Refund(Link& l, size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Hands complete early messages of `tag` to receives posted for it, in order.
  void DeliverEarly(Link& l, uint64_t tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A connection's reader and writer threads, from when it is made until it breaks or the mesh
  // closes; the reader's "gave up" frames.
  void ReadLoop(Link& l);
  void WriteLoop(Link& l);
  absl::StatusOr<std::string> ReadGaveUp(Link& l, uint64_t size);

  // Joins the threads of `links` (shut down already) and closes their sockets.
  static void Join(std::vector<std::unique_ptr<Link>>& links);

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

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_TCP_MESH_IMPL_H_
