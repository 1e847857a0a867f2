// Transport: point-to-point byte transfers between the ranks of one group, the only thing the
// collective engine needs from a network. Operations are asynchronous: post sends and receives,
// then wait for them, so the engine can compute the next block while the previous one is on the
// wire.
//
// Contract:
//   - A receive is posted with the exact number of bytes it expects; the engine learns that number
//     from a fixed-size step header it receives first (engine/step_header.h), never trusting a
//     payload's length blindly (Gloo silently truncates short sends and aborts on long ones).
//   - Messages between a pair of ranks with the same tag are matched in posting order.
//   - Wait fails with DEADLINE_EXCEEDED (naming the peer, tag and timeout) when the operation has
//     not completed by the deadline, and with UNAVAILABLE/ABORTED when the peer is gone or the
//     transport was aborted. After any failure the transport is unusable for this group; the
//     owner re-forms the group.
//   - Abort may be called from any thread (a watchdog) and makes every pending and future Wait
//     fail promptly.
// Otherwise not thread-safe: one collective at a time drives a transport.
#ifndef DQ_ENGINE_TRANSPORT_H_
#define DQ_ENGINE_TRANSPORT_H_

#include <stddef.h>
#include <stdint.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace dynamiq::engine {

class DatagramTransport;

// What a transport promises (engine/transport_registry.h lists every kind with its own). Data
// paths and the algorithm selector read these instead of asking for a transport by name.
struct TransportCapabilities {
  // The registry's name: "tcp", "gloo", "nccl", "memory", "host_staged".
  std::string kind;
  // Every message arrives whole and intact, or the transport fails (the contract above). The
  // collective engines need it; a datagram transport does not give it and has its own interface
  // (engine/datagram_transport.h).
  bool reliable = true;
  // Messages of one tag between a pair match in posting order.
  bool ordered = true;
  // Sends and receives take device (GPU) memory; otherwise host memory.
  bool device_memory = false;
  // SupportsParts: a message sent from, or received into, several buffers.
  bool scatter_gather = false;
};

class Transport {
 public:
  // Identifies a posted operation until Wait returns for it.
  using Handle = uint64_t;

  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // e.g. "gloo_tcp", "nccl", "memory".
  virtual std::string name() const = 0;
  // What this transport promises. The default is a reliable, ordered host transport of kind
  // name(); a transport whose kind or memory differs states its own.
  virtual TransportCapabilities capabilities() const {
    TransportCapabilities c;
    c.kind = name();
    c.scatter_gather = SupportsParts();
    return c;
  }

  // `data` / `buffer` must stay valid until Wait returns for the handle.
  virtual absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) = 0;
  virtual absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) = 0;
  // Scatter/gather, where SupportsParts(): one message sent from several buffers (their bytes in
  // order), or received into several (filled in order; a shorter message leaves the rest as it
  // was). Lets the engine send a message's body from memory it already holds and receive it where
  // it belongs, without copies (engine/rank_executor.h). Gloo and NCCL move a message from one
  // buffer only: without support, more than one part is UNIMPLEMENTED and the engine copies.
  virtual bool SupportsParts() const { return false; }
  virtual absl::StatusOr<Handle> PostSendParts(int peer, uint64_t tag,
                                               absl::Span<const absl::Span<const uint8_t>> parts);
  virtual absl::StatusOr<Handle> PostRecvParts(int peer, uint64_t tag, absl::Span<const absl::Span<uint8_t>> parts);
  virtual absl::Status Wait(Handle handle, absl::Time deadline) = 0;
  // The caller's word on how many bytes of a completed receive were `peer`'s message: receives may
  // be posted larger than the message, and Gloo cannot tell how much arrived (the engine learns it
  // from the step header). Counting decorators (server/counting_transport.h) count received bytes
  // from it; transports ignore it.
  virtual void MessageReceived(int peer, size_t bytes) {}
  // The group's unreliable datagram transport beside this one, same ranks (engine/
  // transport_with_datagrams.h: dynamiqd --transport=udp), for collectives that end at a deadline
  // with what arrived; null where there is none. Aborting this transport aborts it too.
  virtual DatagramTransport* datagrams() { return nullptr; }

  virtual void Abort() = 0;
};

inline absl::StatusOr<Transport::Handle> Transport::PostSendParts(int peer, uint64_t tag,
                                                                  absl::Span<const absl::Span<const uint8_t>> parts) {
  if (parts.size() == 1) return PostSend(peer, tag, parts[0]);
  return absl::UnimplementedError(name() + " transport: no scatter/gather sends");
}

inline absl::StatusOr<Transport::Handle> Transport::PostRecvParts(int peer, uint64_t tag,
                                                                  absl::Span<const absl::Span<uint8_t>> parts) {
  if (parts.size() == 1) return PostRecv(peer, tag, parts[0]);
  return absl::UnimplementedError(name() + " transport: no scatter/gather receives");
}

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_TRANSPORT_H_
