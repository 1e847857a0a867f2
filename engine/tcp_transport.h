// TcpTransport: engine::Transport over plain TCP sockets, without Gloo.
//
// Why: on fast links Gloo's transport is what an all-reduce pays for most (docs/design.md, "The
// transport is the lever left"): every Gloo message is a rendezvous (the receiver's "ready" notice
// travels to the sender before any data moves) and every completion a handoff through its
// event-loop thread. Here each pair of ranks shares one TCP connection carrying framed messages
// (16-byte frame: tag, size; then the payload), sent as soon as they are posted and read as soon as
// they arrive, straight into the receive posted for their tag when there is one.
//
// Contract (engine/transport.h), and what this transport adds:
//   - Messages between a pair with the same tag match receives in posting order.
//   - A message that arrives before its receive is posted is kept (copied) until the receive comes,
//     up to `max_early_bytes` per transport (each message charged its payload plus 1 KiB for its
//     bookkeeping, so a flood of empty messages is bounded too) and `max_early_messages` per peer;
//     past that the peer's connection waits (TCP back pressure) until its receive is posted. What
//     is kept goes with the transport. A message longer than its posted receive fails the
//     transport with INVALID_ARGUMENT (Gloo would terminate the process): the engine's step headers
//     keep honest peers within their receives.
//   - A peer whose connection closes or breaks fails what is still to come from or go to it
//     (UNAVAILABLE, naming the peer, at Wait: posting still succeeds); what it sent before is
//     still delivered, so the first error a caller meets is the peer's own (a bad header it sent
//     before leaving), and the other peers carry on (a rank that finished its part of a collective may leave first).
//     Abort() (any thread) fails the whole transport with ABORTED: every pending and later Wait fails. Before its
//     sockets close it lets a writer finish the message it is writing (up to 200 ms), sends what is still posted as far
//     as each socket takes it without waiting (up to 64 KiB per peer: a step header that shows the peer why the
//     collective failed) and then a frame (tag all ones) with why this rank gave up, the first peer it lost if any: the
//     peer's UNAVAILABLE says "rank <r> gave up: <why>" (<why> made safe to log: common/safe_text.h; with a key, a
//     frame without its sender's MAC is refused).
//   - Connections open with a hello (engine/tcp_hello.h): with `key`, both ends prove they hold the
//     job's key, so no other process can take a rank's place or speak for one; without, any
//     process that reaches the port can claim a rank not yet connected (docs/security.md).
//   - Scatter/gather (SupportsParts): a message sent from several buffers goes out in one sendmsg;
//     a receive in several buffers is filled in order.
// Threads: one reader and one writer per peer. Thread-safe as engine::Transport requires (one
// collective at a time posts and waits; Abort from anywhere).
//
// ConnectTcpTransport's transport is the one view of a mesh made for it (engine/tcp_mesh.h, whose
// views of a job keep their pairs' connections across group views): its Abort closes its
// connections, as nothing would use them again.
#ifndef DQ_ENGINE_TCP_TRANSPORT_H_
#define DQ_ENGINE_TCP_TRANSPORT_H_

#include <stddef.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/hmac.h"
#include "engine/store.h"
#include "engine/transport.h"

namespace dynamiq::engine {

struct TcpTransportOptions {
  // Address this rank listens on and advertises (an IP address or a name that resolves to one).
  std::string hostname = "127.0.0.1";
  // Bounds the rendezvous (store waits, connecting and the hello exchange).
  absl::Duration timeout = absl::Seconds(30);
  // Bytes of messages that arrived before their receive was posted that the transport keeps.
  size_t max_early_bytes = size_t{64} << 20;
  // ... and how many such messages per peer.
  size_t max_early_messages = 4096;
  // The job's key (engine/step_auth.h StepAuthenticator::KeyForJob) when the cluster has a secret:
  // every hello is then authenticated both ways (engine/tcp_hello.h).
  std::optional<common::HmacSha256::Digest> key;
  // How long an accepted connection may take to introduce itself.
  absl::Duration hello_timeout = absl::Seconds(3);
};

// Rendezvouses through `store` (keys "tcp/<rank>"; give every group and epoch its own
// PrefixStore) and connects `rank` to every other rank of `size`: rank r connects to every lower
// rank and accepts the higher ones (concurrently), each connection opened by a hello naming the
// rank. Every rank must call it with the same store, size and key. INVALID_ARGUMENT for a bad
// rank/size, DEADLINE_EXCEEDED when peers do not show up within the timeout (naming connections
// turned away), UNAUTHENTICATED when a lower rank cannot prove the key, UNAVAILABLE for socket
// errors.
absl::StatusOr<std::unique_ptr<Transport>> ConnectTcpTransport(Store& store, int rank, int size,
                                                               const TcpTransportOptions& options);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_TCP_TRANSPORT_H_
