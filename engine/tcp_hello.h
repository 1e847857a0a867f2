// The hello that opens each connection of the TCP transport (engine/tcp_transport.h): who the
// connecting rank is and, when the job has a key, proof in both directions that each end holds it.
//
// Rank q connects to every lower rank r and speaks first:
//   without a key:  "DCT1" | q (u32 LE)                                     8 bytes
//   with a key:     "DCT2" | q | nonce_q (16 random bytes)                  24 bytes
//                   r answers nonce_r (16) | HMAC(h, "acceptor" r q nonce_q nonce_r)   48 bytes
//                   q proves HMAC(h, "connector" q r nonce_q nonce_r)                  32 bytes
// where h = HMAC(job key, "dynamiq tcp hello v1") and the job key is the step headers' key
// (engine/step_auth.h KeyForJob). Fresh nonces on both sides: a recorded hello cannot be
// replayed, and neither end accepts a peer that does not hold the key. Both ends then derive
// the connection's session key HMAC(h, "session" r q nonce_q nonce_r), which authenticates the
// connection's "gave up" frame (GaveUpMac).
//
// Without a key nothing is proven: any process that reaches the listening port can claim a rank
// that has not connected yet (docs/security.md). With or without one, the first claim of a rank
// that completes its hello holds it; later claims are turned away.
//
// HelloAcceptor accepts concurrently: every connection gets its own short hello deadline, so
// connections that say nothing (or something wrong) never keep a real rank out; at most
// kMaxPendingHellos wait at once (the oldest is dropped for a new one).
#ifndef DQ_ENGINE_TCP_HELLO_H_
#define DQ_ENGINE_TCP_HELLO_H_

#include <stddef.h>
#include <stdint.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/hmac.h"

namespace dynamiq::engine {

// A connected, introduced peer.
struct TcpLink {
  int peer = -1;
  int fd = -1;  // owned by whoever holds the link
  // Keyed hellos only: the connection's session key, which MACs its "gave up" frames.
  std::shared_ptr<const common::HmacSha256> session;
};

// The MAC of a "gave up" frame saying `reason`, from `sender` to `receiver`, under a connection's
// session key.
common::HmacSha256::Digest GaveUpMac(const common::HmacSha256& session, int sender, int receiver,
                                     absl::string_view reason);

// Connects `rank` to lower rank `peer` at host:port and introduces it (with `key`: proven both
// ways). UNAUTHENTICATED when the peer's proof is wrong, UNAVAILABLE when it closes the
// connection during the hello (it runs without the key, or the rank's place is taken),
// DEADLINE_EXCEEDED at `deadline`.
absl::StatusOr<TcpLink> DialPeer(const std::string& host, const std::string& port, int rank, int peer,
                                 const std::optional<common::HmacSha256::Digest>& key, absl::Time deadline);

class HelloAcceptor {
 public:
  static constexpr size_t kMaxPendingHellos = 64;

  // Accepts ranks rank+1 .. size-1 on `listener` (non-blocking; not owned); with `wanted` (size
  // entries), only the higher ranks it marks (engine/tcp_mesh.h: the others' connections are kept).
  HelloAcceptor(int listener, int rank, int size, std::optional<common::HmacSha256::Digest> key,
                absl::Duration hello_timeout, std::vector<bool> wanted = {});
  ~HelloAcceptor();
  HelloAcceptor(const HelloAcceptor&) = delete;
  HelloAcceptor& operator=(const HelloAcceptor&) = delete;

  // Until every wanted higher rank has connected: their links, by rank. DEADLINE_EXCEEDED at `deadline`
  // naming how many did not connect (and how many connections were turned away, and why).
  // `interrupted` (may be empty), asked every kInterruptPoll while waiting: a non-OK status from it
  // is returned at once.
  absl::StatusOr<std::vector<TcpLink>> AcceptAll(absl::Time deadline, absl::Duration timeout_for_message,
                                                 const std::function<absl::Status()>& interrupted = nullptr);
  static constexpr absl::Duration kInterruptPoll = absl::Milliseconds(250);

 private:
  struct Pending;

  void AcceptNew();
  // Reads what `p` sent and answers it; its fd is -1 once it is done with (accepted or turned away).
  void Advance(Pending& p);
  void TurnAway(Pending& p, const std::string& why);

  const int listener_, rank_, size_;
  std::unique_ptr<common::HmacSha256> hello_;  // null without a key
  const absl::Duration hello_timeout_;
  std::vector<std::unique_ptr<Pending>> pending_;
  std::vector<bool> wanted_;    // by rank
  std::vector<TcpLink> links_;  // by rank
  int missing_;
  int turned_away_ = 0;
  std::string last_turned_away_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_TCP_HELLO_H_
