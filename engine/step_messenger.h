// StepMessenger: the messages of one collective over a transport, each a validated step header
// (engine/step_header.h) and its payload. What the all-reduce's reduce-scatter, all-gather and
// statistics phases send and receive goes through it.
//
// A message is a 64-byte header and its payload, sent back to back without waiting for the
// receiver. The receiver posts header receives ahead of time (PostReceive); a payload's receive is
// posted only once its header has been checked (Announce): same collective and configuration,
// authentication mode, announced size within the plan's bound. Gloo moves a payload only when its
// receive is posted, so the payload of a peer that runs a different collective (say, a tensor of
// another size) is never taken, and Gloo never sees a message longer than its receive (which would
// terminate this process). Once a peer's first header has matched, the peer runs this very
// collective (job and tensor size, epoch, codec, bits, sequence), so its honest payloads are within
// the plan's bounds: its payload receives are then posted at the bound right away, with their
// headers, and its payloads flow without waiting for this rank at all (Gloo completes a shorter
// message into a larger receive; the header says how many bytes are the message). Callers
// announce the messages of not-yet-trusted peers before they decode them. Receive verifies the
// MAC before anyone decodes the payload, and the checksum too unless the caller defers it to the
// decoding (Codec::DecompressVerified: one pass over the payload).
#ifndef DQ_ENGINE_STEP_MESSENGER_H_
#define DQ_ENGINE_STEP_MESSENGER_H_

#include <stdint.h>

#include <array>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "engine/allreduce.h"
#include "engine/buffer_pool.h"
#include "engine/step_header.h"
#include "engine/transport.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

class StepMessenger {
 public:
  StepMessenger(Transport& transport, const AllReduceOptions& options, BufferPool& pool, absl::Time deadline,
                AllReduceResult& result)
      : t_(transport), o_(options), pool_(pool), deadline_(deadline), result_(result) {}
  // Operations still posted mean the collective failed: abort the transport before their buffers
  // are reused or freed, so nothing can write into them afterwards.
  ~StepMessenger();

  // A message is named by (phase, step, block, peer): the peer is the sender of a receive and the
  // receiver of a send, so a step may carry one message per link (a schedule step with several
  // transfers per rank, engine/schedule.h).

  // Posts the header receive of the message (phase, step, block) from `peer`, whose payload may
  // have at most `max_bytes`. With a `body` (the transport must SupportsParts): the payload has
  // exactly `max_bytes`, its last body.size() bytes land in `body` (e.g. the output: no copy),
  // and Receive returns the rest and verifies the checksum of both.
  absl::Status PostReceive(Phase phase, uint32_t step, uint32_t block, int peer, size_t max_bytes,
                           absl::Span<uint8_t> body = {});

  // Whether `peer`'s headers have matched this collective (see the class comment).
  bool Trusts(int peer) const { return trusted_.count(peer) != 0; }

  // Waits for the header of a posted message, checks it and posts the receive of exactly the
  // payload it announces. Idempotent.
  absl::Status Announce(Phase phase, uint32_t step, uint32_t block, int peer, const kernels::Codec& codec);

  // Sends `payload` as message (phase, step, block) to `peer`; it must stay valid until WaitSent.
  // `checksum`: its PayloadChecksum when the caller knows it (computed while encoding, or received
  // with it), so it is not computed again. A `body` follows `payload` in the same message, sent from
  // where it is (the transport must SupportsParts; not with an authenticator).
  absl::Status Send(Phase phase, uint32_t step, uint32_t block, int peer, const kernels::Codec& codec,
                    absl::Span<const uint8_t> payload, std::optional<uint64_t> checksum = std::nullopt,
                    absl::Span<const uint8_t> body = {});

  // Waits until the message (phase, step, block) to `peer` has left (its payload may then be
  // reused); no-op when none was sent.
  absl::Status WaitSent(Phase phase, uint32_t step, uint32_t block, int peer);

  // Waits for the posted message (phase, step, block) from `peer` and checks it (see the class comment). The
  // payload stays valid until Release. With `deferred` and no authenticator, the payload's checksum
  // is not verified here but returned there, for the caller to verify as it decodes
  // (Codec::DecompressVerified): one pass over the payload instead of two. A MAC is always
  // verified here, before anything decodes the payload.
  absl::StatusOr<absl::Span<const uint8_t>> Receive(Phase phase, uint32_t step, uint32_t block, int peer,
                                                    const kernels::Codec& codec,
                                                    std::optional<uint64_t>* deferred = nullptr);

  // Hands a received payload's buffer back.
  void Release(Phase phase, uint32_t step, uint32_t block, int peer);
  // Instead of Release: the received payload's buffer, sized to the payload, for the caller to keep
  // (e.g. to forward it) and give back to the pool, with its header's checksum (none with a MAC;
  // verified by Receive unless deferred).
  struct TakenPayload {
    Bytes bytes;
    std::optional<uint64_t> checksum;
  };
  TakenPayload TakePayload(Phase phase, uint32_t step, uint32_t block, int peer);

 private:
  StepHeader Expected(Phase phase, uint32_t step, size_t block, const kernels::Codec& codec, int sender) const;
  // Both sides of a link must authenticate, or neither.
  absl::Status CheckAuthenticationMode(const StepHeader& received, int peer) const;
  template <typename T>
  static T Peer(T status_or, int peer) {
    if (status_or.ok()) return status_or;
    const absl::Status& s = [&]() -> const absl::Status& {
      if constexpr (std::is_same_v<T, absl::Status>) {
        return status_or;
      } else {
        return status_or.status();
      }
    }();
    return common::Annotate(s, absl::StrCat("from rank ", peer));
  }

  struct Incoming {
    int peer = -1;
    uint64_t tag = 0;  // the payload's
    size_t max_bytes = 0;
    std::array<uint8_t, kStepHeaderBytes> header_bytes{};
    StepHeader decoded;        // once announced
    Bytes payload;             // the announced size (or the bound, when trusted), from the pool; without the body
    absl::Span<uint8_t> body;  // where the payload's last bytes go (PostReceive)
    Transport::Handle header = 0, body_handle = 0;
    bool payload_posted = false, announced = false, received = false;
  };
  struct Outgoing {
    int peer = -1;
    std::array<uint8_t, kStepHeaderBytes> header_bytes{};
    Transport::Handle header = 0, body = 0;
  };
  absl::Status PostPayload(Incoming& in, size_t bytes);
  // (phase, step, block, peer).
  using Key = std::tuple<uint8_t, uint32_t, uint32_t, int>;
  static Key KeyOf(Phase phase, uint32_t step, uint32_t block, int peer) {
    return {static_cast<uint8_t>(phase), step, block, peer};
  }

  Transport& t_;
  const AllReduceOptions& o_;
  BufferPool& pool_;
  // Node-based maps: posted buffers never move.
  std::map<Key, Incoming> incoming_;
  std::map<Key, Outgoing> outgoing_;
  std::set<int> trusted_;  // peers whose header matched
  absl::Time deadline_;
  AllReduceResult& result_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_STEP_MESSENGER_H_
