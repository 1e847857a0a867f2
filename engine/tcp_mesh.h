// TcpMesh: one node's TCP connections to the other nodes of a job, one per pair, made once and
// kept, and the transports of the job's group views over them (the model: NCCL's communicator
// split and shrink, which build a smaller group over what the larger one set up).
//
// Why: a job's group of nodes changes (a node is dropped on its heartbeats, comes back, a
// collective fails and the group re-forms: server/cross_node_group.h). Connecting every view from
// nothing costs a rendezvous, a TCP and hello handshake per pair and, on a long link, slow start
// again; a view that only drops members, or re-forms after a failed exchange, needs none of it.
//
// Connect(store, members, session) makes the transport (engine::Transport, as
// engine/tcp_transport.h describes it, ranks = indices into `members`) of the view whose members
// are `members` (node ids, ascending, this node among them) for `session` (the view's epoch and
// the first collective it carries: each Connect of a job a later session than the one before).
// A pair keeps its connection when both ends hold it intact (not broken, and not waiting out a
// retransmission timeout: one that went through a cut link would be seconds late once the link is
// back) and it has carried only earlier sessions: every member publishes which connections it holds (store key
// "mesh/<rank>", beside the address "tcp/<rank>"), so both ends of a pair decide alike; the other pairs connect as
// ConnectTcpTransport's ranks do (the lower rank accepts, the higher dials, with the hello of
// engine/tcp_hello.h). One view at a time: Connect refuses while the last view's transport is
// still there.
//
// A kept connection carries several sessions one after another. When a view attaches, it sends a
// fence frame naming its session (engine/tcp_frame.h) before any of its messages, so a reader knows
// which session every message belongs to: those of the view it serves are delivered; those of a
// later session (its peer got there first) are kept, within the early-message bounds, until that
// view comes; those of an earlier one (an exchange that was cut short) are read and dropped. A
// transport's Abort ends its view's exchange and leaves the connections: writers finish the
// message they are writing, what is still posted goes out as far as the sockets take it without
// waiting, and a "gave up" frame tells each peer's view why; a connection whose framing could be
// lost (a message half written, or a reader inside a posted buffer 200 ms after the abort) is
// closed instead, and the pair connects again for the next view. A connection that breaks fails
// what the view has pending with that peer (UNAVAILABLE) and is made again for the next view.
//
// Thread-safe. The mesh lives as long as its owner and every transport made from it.
#ifndef DQ_ENGINE_TCP_MESH_H_
#define DQ_ENGINE_TCP_MESH_H_

#include <stdint.h>

#include <compare>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/store.h"
#include "engine/tcp_transport.h"
#include "engine/transport.h"

namespace dynamiq::engine {

// Which view of a job a transport serves: its epoch, and the first collective it carries.
struct TcpMeshSession {
  uint64_t epoch = 0;
  uint64_t sequence = 0;
  auto operator<=>(const TcpMeshSession&) const = default;
};

class TcpMesh {
 public:
  // This node is `node` of `num_nodes`; `options` as the TCP transport's (the address to listen
  // on, the rendezvous timeout, the early-message bounds (for all connections together), the key).
  // Without `keep_connections` an abort closes its view's connections, as a transport that is the
  // only one of its connections does (ConnectTcpTransport).
  TcpMesh(int node, int num_nodes, TcpTransportOptions options, bool keep_connections = true);
  ~TcpMesh();
  TcpMesh(const TcpMesh&) = delete;
  TcpMesh& operator=(const TcpMesh&) = delete;

  // The transport of the view `members` for `session` (see above). INVALID_ARGUMENT for members
  // that are not ascending node ids including this node; FAILED_PRECONDITION while an earlier
  // view's transport is still there; otherwise what ConnectTcpTransport returns.
  absl::StatusOr<std::unique_ptr<Transport>> Connect(Store& store, const std::vector<int>& members,
                                                     TcpMeshSession session);

  // Connections made and kept by Connect so far (a pair's counted once per Connect).
  struct Counts {
    uint64_t made = 0;
    uint64_t kept = 0;
  };
  Counts counts() const;

  class Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_TCP_MESH_H_
