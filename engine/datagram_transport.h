// DatagramTransport: unreliable, unordered, self-contained messages between the ranks of one group,
// for collectives that end at a deadline with what arrived instead of waiting for every byte
// (issue #36's loss-tolerant all-reduce). It is its own interface, not an engine::Transport, so the
// reliable contract the engines rely on (engine/transport.h) is never weakened; the transport
// registry (engine/transport_registry.h) lists its kinds with reliable = ordered = false.
//
// Contract. Promised:
//   - Integrity and authenticity: Receive returns only a datagram that a rank of this group sent
//     to this rank over this connection (this group's rendezvous, not another job's, connection's
//     or incarnation's), byte for byte as sent, with the source rank and tag it was sent with. With
//     the job's key, no process without the key can forge or alter one; without a key a checksum
//     still catches corruption (but anyone can forge).
//   - No duplicates: a datagram is delivered at most once, however often the network or an
//     attacker repeats it.
//   - Every datagram stands alone: whatever else is lost, reordered or delayed, one that arrives
//     intact is delivered.
//   - Nothing a peer or a stranger sends can crash the transport or make it unusable: what is
//     malformed, truncated, unauthenticated, foreign, replayed or stray is dropped and counted
//     (DatagramCounters) and Receive goes on with the next one.
//   - Send never blocks for long and never retransmits: a datagram the kernel would not take now is
//     not sent (RESOURCE_EXHAUSTED, counted), and the transport stays usable.
//   - Receive returns by its deadline (plus scheduling delay) with DEADLINE_EXCEEDED when nothing
//     deliverable arrived, however much undeliverable traffic arrives meanwhile; Abort (any thread)
//     wakes a pending Receive promptly, and every later Send and Receive fails with ABORTED.
// Not promised: delivery (any datagram may be lost, including by a full receive buffer), order
// (between or within tags), timeliness, fairness between peers, or that a sender learns of a loss.
// Whoever needs those builds them above (deadlines, contributor counts, a reliable resync).
//
// Threads: Send, Abort and counters() from any thread, concurrently; Receive and AcceptTags from
// one thread at a time.
#ifndef DQ_ENGINE_DATAGRAM_TRANSPORT_H_
#define DQ_ENGINE_DATAGRAM_TRANSPORT_H_

#include <stddef.h>
#include <stdint.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/transport.h"

namespace dynamiq::engine {

struct DatagramCapabilities {
  // The registry row's promises (kind "udp": reliable and ordered false, host memory).
  TransportCapabilities transport;
  // The largest payload one datagram carries: Send refuses more, and a Receive buffer must hold it.
  size_t max_payload = 0;
};

// What Receive delivered: the payload is the first `bytes` of the caller's buffer.
struct ReceivedDatagram {
  int source = -1;
  uint64_t tag = 0;
  size_t bytes = 0;
};

// Cumulative since the transport was made. A datagram is counted once: sent or send_dropped on the
// sending side; received (delivered by Receive) or one drop reason on the receiving side.
struct DatagramCounters {
  uint64_t sent = 0;          // handed to the network
  uint64_t send_dropped = 0;  // not sent: the kernel would have blocked (buffer full) or refused it
  uint64_t received = 0;      // delivered by Receive
  // Dropped on arrival, by reason:
  uint64_t malformed = 0;        // too short, too long, a length that disagrees, bad magic/version/fields
  uint64_t unauthenticated = 0;  // the MAC (or, without a key, the checksum) does not match
  uint64_t foreign = 0;          // another connection's: another job, connection or incarnation
  uint64_t replayed = 0;         // delivered before, or too old to tell (behind the replay window)
  uint64_t stray = 0;            // no such peer, not addressed to this rank, or a tag not accepted now

  uint64_t dropped() const { return malformed + unauthenticated + foreign + replayed + stray; }
};

class DatagramTransport {
 public:
  virtual ~DatagramTransport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual DatagramCapabilities capabilities() const = 0;

  // Sends `payload` to `peer` under `tag`, once. INVALID_ARGUMENT for a peer outside the group or
  // this rank itself, or a payload over max_payload; RESOURCE_EXHAUSTED when the kernel would not
  // take it now (counted in send_dropped; later sends may succeed); UNAVAILABLE for another socket
  // error (counted likewise); ABORTED after Abort. OK says it left this rank, not that it arrives.
  virtual absl::Status Send(int peer, uint64_t tag, absl::Span<const uint8_t> payload) = 0;

  // The next deliverable datagram, its payload copied into `buffer` (which must hold max_payload
  // bytes: INVALID_ARGUMENT otherwise). DEADLINE_EXCEEDED when none arrived by `deadline` (a
  // deadline already past still takes one that is waiting), ABORTED after Abort.
  virtual absl::StatusOr<ReceivedDatagram> Receive(absl::Span<uint8_t> buffer, absl::Time deadline) = 0;

  // Only tags in [lowest, highest] are delivered from now on; others are dropped as stray (say, a
  // late datagram of a collective that already ended). All tags by default.
  virtual void AcceptTags(uint64_t lowest, uint64_t highest) = 0;

  // Wakes a pending Receive and fails everything after it with ABORTED. Idempotent.
  virtual void Abort() = 0;

  virtual DatagramCounters counters() const = 0;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_DATAGRAM_TRANSPORT_H_
