// Gloo TCP Transport (engine/transport.h) for ranks in separate processes or hosts: a
// gloo::rendezvous::Context connected as a full mesh (one TCP connection per pair of ranks),
// rendezvoused through our Store, with point-to-point transfers over Gloo unbound buffers
// (slot = tag). Gloo headers stay inside gloo_transport.cc; no Gloo exception escapes it.
//
// Behaviour (libgloo 0.0~git20220518, Debian 12):
//   - PostSend/PostRecv post at once; data moves when both sides have posted (Gloo's rendezvous
//     protocol: the sender writes only after the receiver announced a matching receive).
//   - Zero-byte messages are real Gloo messages (preamble only) and match like any other.
//   - A receive must be posted with the exact size the sender sends (the engine's StepHeader
//     guarantees it): Gloo silently completes a shorter send into a larger receive, and a longer
//     send into a shorter receive fails an assertion on Gloo's event-loop thread, which terminates
//     the process. The transport cannot detect either.
//   - Wait turns Gloo outcomes into Status: a timeout is DEADLINE_EXCEEDED naming the peer, tag and
//     timeout; a reset or closed connection is UNAVAILABLE naming the peer; Abort is ABORTED.
//   - After the first failed Wait (or Abort) the transport is unusable: it closes all of its
//     connections, so peers fail fast with UNAVAILABLE instead of waiting for their deadlines and
//     no Gloo thread touches a caller's buffer after that, and every later Post/Wait fails at once
//     with the first error's code.
//   - Abort may be called from any thread; it wakes a blocked Wait promptly. After Abort returns,
//     Gloo no longer reads or writes any posted buffer, so the caller may free them.
// Otherwise one thread drives the transport (as Transport requires).
#ifndef DQ_ENGINE_GLOO_TRANSPORT_H_
#define DQ_ENGINE_GLOO_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/store.h"
#include "engine/transport.h"

namespace dynamiq::engine {

struct GlooTransportOptions {
  // Address this rank's Gloo device binds and advertises. Always set it: Gloo's default resolves
  // gethostname(), which Debian maps to 127.0.1.1 (unreachable from other hosts).
  std::string hostname = "127.0.0.1";
  // Bounds the rendezvous (store waits and TCP connection setup) and is the Gloo context's
  // default timeout.
  absl::Duration timeout = absl::Seconds(30);
};

// Rendezvouses through `store` (under the key prefix "gloo/"; give every group and epoch its own
// PrefixStore) and connects `rank` to every other rank of `size`. Every rank of the group must
// call it with the same store, size and timeout. Errors: INVALID_ARGUMENT for bad rank/size,
// DEADLINE_EXCEEDED when peers do not show up within the timeout, UNAVAILABLE for network
// errors, INTERNAL for anything else Gloo reports. `store` is only used during this call.
absl::StatusOr<std::unique_ptr<Transport>> ConnectGlooTransport(Store& store, int rank, int size,
                                                                const GlooTransportOptions& options = {});

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_GLOO_TRANSPORT_H_
