#include "engine/step_messenger.h"

#include <cmath>
#include <utility>

#include "kernels/payload_checksum.h"

namespace dynamiq::engine {
namespace {

using kernels::Codec;

// Distinct transport tags for every message of a collective: sequence, phase, step, block, part.
enum Part { kHeader = 0, kPayload = 1 };
uint64_t Tag(uint64_t sequence, Phase phase, uint32_t step, uint32_t block, Part part) {
  return ((sequence & 0xffffff) << 40) | (static_cast<uint64_t>(phase) << 38) |
         (static_cast<uint64_t>(step & 0xffff) << 22) | (static_cast<uint64_t>(block & 0xfffff) << 2) |
         static_cast<uint64_t>(part);
}

uint32_t BitsX1000(const Codec& codec) { return static_cast<uint32_t>(std::lround(codec.config().bits * 1000)); }

}  // namespace

StepMessenger::~StepMessenger() {
  if (!incoming_.empty() || !outgoing_.empty()) t_.Abort();
  for (auto& [key, in] : incoming_) pool_.Give(std::move(in.payload));
}

absl::Status StepMessenger::PostReceive(Phase phase, uint32_t step, uint32_t block, int peer, size_t max_bytes,
                                        absl::Span<uint8_t> body) {
  auto [it, fresh] = incoming_.try_emplace(KeyOf(phase, step, block, peer));
  if (!fresh) return absl::OkStatus();
  Incoming& in = it->second;
  in.peer = peer;
  in.max_bytes = max_bytes;
  if (body.size() > max_bytes) return absl::InternalError("a receive's body is larger than its payload");
  in.body = body;
  // A peer that already reset the connection fails the post itself: name it as every other failure
  // of this peer is named ("from rank <peer>: ").
  DQ_ASSIGN_OR_RETURN(
      in.header,
      Peer(t_.PostRecv(peer, Tag(o_.sequence, phase, step, block, kHeader), absl::MakeSpan(in.header_bytes)), peer));
  in.tag = Tag(o_.sequence, phase, step, block, kPayload);
  if (trusted_.count(peer)) DQ_RETURN_IF_ERROR(PostPayload(in, max_bytes));
  return absl::OkStatus();
}

absl::Status StepMessenger::Announce(Phase phase, uint32_t step, uint32_t block, int peer, const Codec& codec) {
  auto it = incoming_.find(KeyOf(phase, step, block, peer));
  if (it == incoming_.end()) {
    return absl::InternalError(absl::StrCat("no receive posted for step ", step, " from rank ", peer));
  }
  Incoming& in = it->second;
  if (in.announced) return absl::OkStatus();
  {
    TimelineSpan span(o_.timeline, Timeline::Kind::kWaitHeader, block);
    DQ_RETURN_IF_ERROR(Peer(t_.Wait(in.header, deadline_), peer));
  }
  DQ_ASSIGN_OR_RETURN(in.decoded, Peer(DecodeStepHeader(in.header_bytes), peer));
  DQ_RETURN_IF_ERROR(MatchStepHeader(in.decoded, Expected(phase, step, block, codec, peer)));
  DQ_RETURN_IF_ERROR(CheckAuthenticationMode(in.decoded, peer));
  if (in.decoded.payload_bytes > in.max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", peer, " announced ", in.decoded.payload_bytes,
                                                   " payload bytes at step ", step, ", at most ", in.max_bytes,
                                                   " are possible"));
  }
  if (!in.body.empty() && in.decoded.payload_bytes != in.max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", peer, " announced ", in.decoded.payload_bytes,
                                                   " payload bytes at step ", step, ", the codec's messages have ",
                                                   in.max_bytes));
  }
  if (!in.payload_posted) DQ_RETURN_IF_ERROR(PostPayload(in, in.decoded.payload_bytes));
  in.announced = true;
  if (trusted_.insert(peer).second) {
    // The receives already posted for this peer need not wait for their headers any more.
    for (auto& [key, other] : incoming_) {
      if (other.peer == peer && !other.payload_posted) DQ_RETURN_IF_ERROR(PostPayload(other, other.max_bytes));
    }
  }
  return absl::OkStatus();
}

absl::Status StepMessenger::Send(Phase phase, uint32_t step, uint32_t block, int peer, const Codec& codec,
                                 absl::Span<const uint8_t> payload, std::optional<uint64_t> checksum,
                                 absl::Span<const uint8_t> body) {
  const size_t bytes = payload.size() + body.size();
  if (bytes > UINT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("message of ", bytes, " bytes exceeds 4 GiB; use smaller pipelining blocks"));
  }
  if (!body.empty() && o_.authenticator != nullptr) return absl::InternalError("split messages are not authenticated");
  auto [it, fresh] = outgoing_.try_emplace(KeyOf(phase, step, block, peer));
  if (!fresh) {
    return absl::InternalError(
        absl::StrCat("message of step ", step, " block ", block, " to rank ", peer, " sent twice"));
  }
  Outgoing& out = it->second;
  StepHeader h = Expected(phase, step, block, codec, t_.rank());
  h.payload_bytes = static_cast<uint32_t>(bytes);
  if (o_.authenticator != nullptr) {
    TimelineSpan span(o_.timeline, Timeline::Kind::kChecksum, block);
    out.header_bytes = o_.authenticator->Seal(h, static_cast<uint32_t>(peer), payload);
  } else if (checksum.has_value()) {
    h.checksum = *checksum;
    out.header_bytes = EncodeStepHeader(h);
  } else {
    TimelineSpan span(o_.timeline, Timeline::Kind::kChecksum, block);
    h.checksum = kernels::PayloadChecksum(payload, body);
    out.header_bytes = EncodeStepHeader(h);
  }
  DQ_ASSIGN_OR_RETURN(out.header,
                      Peer(t_.PostSend(peer, Tag(o_.sequence, phase, step, block, kHeader), out.header_bytes), peer));
  const uint64_t tag = Tag(o_.sequence, phase, step, block, kPayload);
  if (body.empty()) {
    DQ_ASSIGN_OR_RETURN(out.body, Peer(t_.PostSend(peer, tag, payload), peer));
  } else {
    const absl::Span<const uint8_t> parts[] = {payload, body};
    DQ_ASSIGN_OR_RETURN(out.body, Peer(t_.PostSendParts(peer, tag, parts), peer));
  }
  out.peer = peer;
  result_.bytes_sent += kStepHeaderBytes + bytes;
  if (phase == Phase::kStats) result_.stats_bytes_sent += kStepHeaderBytes + bytes;
  return absl::OkStatus();
}

absl::Status StepMessenger::WaitSent(Phase phase, uint32_t step, uint32_t block, int peer) {
  auto it = outgoing_.find(KeyOf(phase, step, block, peer));
  if (it == outgoing_.end()) return absl::OkStatus();
  TimelineSpan span(o_.timeline, Timeline::Kind::kWaitSent, block);
  DQ_RETURN_IF_ERROR(Peer(t_.Wait(it->second.header, deadline_), it->second.peer));
  DQ_RETURN_IF_ERROR(Peer(t_.Wait(it->second.body, deadline_), it->second.peer));
  outgoing_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const uint8_t>> StepMessenger::Receive(Phase phase, uint32_t step, uint32_t block, int peer,
                                                                 const Codec& codec,
                                                                 std::optional<uint64_t>* deferred) {
  DQ_RETURN_IF_ERROR(Announce(phase, step, block, peer, codec));
  Incoming& in = incoming_.at(KeyOf(phase, step, block, peer));
  {
    TimelineSpan span(o_.timeline, Timeline::Kind::kWaitPayload, block);
    DQ_RETURN_IF_ERROR(Peer(t_.Wait(in.body_handle, deadline_), peer));
  }
  const absl::Span<const uint8_t> payload(in.payload.data(), in.decoded.payload_bytes - in.body.size());
  result_.bytes_received += kStepHeaderBytes + in.decoded.payload_bytes;
  // Verified before anything decodes it.
  TimelineSpan span(o_.timeline, Timeline::Kind::kChecksum, block);
  if (!in.body.empty()) {  // never with an authenticator (Send)
    if (o_.authenticator != nullptr || kernels::PayloadChecksum(payload, in.body) != in.decoded.checksum) {
      return absl::DataLossError(absl::StrCat("payload from rank ", peer, " at step ", step, " block ", block,
                                              " failed its checksum (corrupted in transit)"));
    }
  } else if (o_.authenticator != nullptr) {
    if (!o_.authenticator->Verify(in.header_bytes, static_cast<uint32_t>(t_.rank()), payload)) {
      return absl::UnauthenticatedError(absl::StrCat(
          "authentication failed: the message from rank ", peer, " at step ", step, " block ", block,
          " has a bad MAC (a different cluster secret, or altered in transit); its payload was not decoded"));
    }
  } else if (deferred != nullptr) {
    *deferred = in.decoded.checksum;
  } else if (PayloadChecksum(payload) != in.decoded.checksum) {
    return absl::DataLossError(absl::StrCat("payload from rank ", peer, " at step ", step, " block ", block,
                                            " failed its checksum (corrupted in transit)"));
  }
  in.received = true;
  t_.MessageReceived(peer, kStepHeaderBytes + in.decoded.payload_bytes);
  return payload;
}

void StepMessenger::Release(Phase phase, uint32_t step, uint32_t block, int peer) {
  auto it = incoming_.find(KeyOf(phase, step, block, peer));
  if (it == incoming_.end() || !it->second.received) return;
  pool_.Give(std::move(it->second.payload));
  incoming_.erase(it);
}

StepMessenger::TakenPayload StepMessenger::TakePayload(Phase phase, uint32_t step, uint32_t block, int peer) {
  auto it = incoming_.find(KeyOf(phase, step, block, peer));
  if (it == incoming_.end() || !it->second.received) return {};
  TakenPayload taken{std::move(it->second.payload), std::nullopt};
  taken.bytes.resize(it->second.decoded.payload_bytes - it->second.body.size());
  if (o_.authenticator == nullptr) taken.checksum = it->second.decoded.checksum;
  incoming_.erase(it);
  return taken;
}

StepHeader StepMessenger::Expected(Phase phase, uint32_t step, size_t block, const Codec& codec, int sender) const {
  StepHeader h;
  h.phase = phase;
  h.codec = static_cast<uint8_t>(codec.id());
  h.schedule = ScheduleId(o_.topology);
  // A per-collective b̄ (AllReduceOptions::bits) replaces DynamiQ's setting, not the statistics'
  // codec's.
  h.bits_x1000 = o_.bits != 0 && codec.id() == kernels::CodecId::kDynamiq
                     ? static_cast<uint32_t>(std::lround(o_.bits * 1000))
                     : BitsX1000(codec);
  h.sender = static_cast<uint32_t>(sender);
  h.job_id = o_.job_id;
  h.config_epoch = o_.config_epoch;
  h.sequence = o_.sequence;
  h.step = step;
  h.block = static_cast<uint32_t>(block);
  return h;
}

absl::Status StepMessenger::CheckAuthenticationMode(const StepHeader& received, int peer) const {
  if (o_.authenticator != nullptr && !received.authenticated) {
    return absl::UnauthenticatedError(absl::StrCat("authentication failed: rank ", peer,
                                                   " sent an unauthenticated message (it has no cluster secret?)"));
  }
  if (o_.authenticator == nullptr && received.authenticated) {
    return absl::UnauthenticatedError(
        absl::StrCat("rank ", peer, " authenticates its messages with a cluster secret, but this rank has none"));
  }
  return absl::OkStatus();
}

absl::Status StepMessenger::PostPayload(Incoming& in, size_t bytes) {
  in.payload = pool_.Take(bytes - in.body.size());
  in.payload.resize(bytes - in.body.size());
  if (in.body.empty()) {
    DQ_ASSIGN_OR_RETURN(in.body_handle, Peer(t_.PostRecv(in.peer, in.tag, absl::MakeSpan(in.payload)), in.peer));
  } else {
    const absl::Span<uint8_t> parts[] = {absl::MakeSpan(in.payload), in.body};
    DQ_ASSIGN_OR_RETURN(in.body_handle, Peer(t_.PostRecvParts(in.peer, in.tag, parts), in.peer));
  }
  in.payload_posted = true;
  return absl::OkStatus();
}

}  // namespace dynamiq::engine
