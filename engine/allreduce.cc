#include "engine/allreduce.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/block_plan.h"
#include "engine/rank_executor.h"
#include "engine/stats_exchange.h"
#include "engine/step_header.h"
#include "kernels/codec_registry.h"
#include "kernels/dtype.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::engine {
namespace {

using kernels::BucketPlan;
using kernels::Codec;

// Prefixes an error with this rank's identity (keeps the code).
absl::Status Annotate(const absl::Status& s, int rank) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("rank ", rank, ": ", s.message()));
}

// Distinct transport tags for every message of a collective: sequence, phase, step, block, part.
enum Part { kHeader = 0, kPayload = 1 };
uint64_t Tag(uint64_t sequence, Phase phase, uint32_t step, uint32_t block, Part part) {
  return ((sequence & 0xffffff) << 40) | (static_cast<uint64_t>(phase) << 38) |
         (static_cast<uint64_t>(step & 0xffff) << 22) | (static_cast<uint64_t>(block & 0xfffff) << 2) |
         static_cast<uint64_t>(part);
}

uint32_t BitsX1000(const Codec& codec) { return static_cast<uint32_t>(std::lround(codec.config().bits * 1000)); }

// Moves the messages of collectives over one transport, with validated step headers.
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
// checksum or MAC before anyone decodes the payload.
class Runner {
 public:
  Runner(Transport& transport, const AllReduceOptions& options, BufferPool& pool, absl::Time deadline,
         AllReduceResult& result)
      : t_(transport), o_(options), pool_(pool), deadline_(deadline), result_(result) {}
  // Operations still posted mean the collective failed: abort the transport before their buffers
  // are reused or freed, so nothing can write into them afterwards.
  ~Runner() {
    if (!incoming_.empty() || !outgoing_.empty()) t_.Abort();
    for (auto& [key, in] : incoming_) pool_.Give(std::move(in.payload));
  }

  // Posts the header receive of the message (phase, step, block) from `peer`, whose payload may
  // have at most `max_bytes`.
  absl::Status PostReceive(Phase phase, uint32_t step, uint32_t block, int peer, size_t max_bytes) {
    auto [it, fresh] = incoming_.try_emplace(Key(phase, step, block));
    if (!fresh) return absl::OkStatus();
    Incoming& in = it->second;
    in.peer = peer;
    in.max_bytes = max_bytes;
    // A peer that already reset the connection fails the post itself: name it as every other failure
    // of this peer is named ("from rank <peer>: ").
    DQ_ASSIGN_OR_RETURN(
        in.header,
        Peer(t_.PostRecv(peer, Tag(o_.sequence, phase, step, block, kHeader), absl::MakeSpan(in.header_bytes)), peer));
    in.tag = Tag(o_.sequence, phase, step, block, kPayload);
    if (trusted_.count(peer)) DQ_RETURN_IF_ERROR(PostPayload(in, max_bytes));
    return absl::OkStatus();
  }

  // Whether `peer`'s headers have matched this collective (see the class comment).
  bool Trusts(int peer) const { return trusted_.count(peer) != 0; }

  // Waits for the header of a posted message, checks it and posts the receive of exactly the
  // payload it announces. Idempotent.
  absl::Status Announce(Phase phase, uint32_t step, uint32_t block, const Codec& codec) {
    auto it = incoming_.find(Key(phase, step, block));
    if (it == incoming_.end()) return absl::InternalError(absl::StrCat("no receive posted for step ", step));
    Incoming& in = it->second;
    if (in.announced) return absl::OkStatus();
    const int peer = in.peer;
    DQ_RETURN_IF_ERROR(Peer(t_.Wait(in.header, deadline_), peer));
    DQ_ASSIGN_OR_RETURN(in.decoded, Peer(DecodeStepHeader(in.header_bytes), peer));
    DQ_RETURN_IF_ERROR(MatchStepHeader(in.decoded, Expected(phase, step, block, codec, peer)));
    DQ_RETURN_IF_ERROR(CheckAuthenticationMode(in.decoded, peer));
    if (in.decoded.payload_bytes > in.max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", peer, " announced ", in.decoded.payload_bytes,
                                                     " payload bytes at step ", step, ", at most ", in.max_bytes,
                                                     " are possible"));
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

  // Sends `payload` as message (phase, step, block) to `peer`; it must stay valid until WaitSent.
  absl::Status Send(Phase phase, uint32_t step, uint32_t block, int peer, const Codec& codec,
                    absl::Span<const uint8_t> payload) {
    if (payload.size() > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("message of ", payload.size(), " bytes exceeds 4 GiB; use smaller pipelining blocks"));
    }
    auto [it, fresh] = outgoing_.try_emplace(Key(phase, step, block));
    if (!fresh) return absl::InternalError(absl::StrCat("message of step ", step, " block ", block, " sent twice"));
    Outgoing& out = it->second;
    StepHeader h = Expected(phase, step, block, codec, t_.rank());
    h.payload_bytes = static_cast<uint32_t>(payload.size());
    if (o_.authenticator != nullptr) {
      out.header_bytes = o_.authenticator->Seal(h, static_cast<uint32_t>(peer), payload);
    } else {
      h.checksum = PayloadChecksum(payload);
      out.header_bytes = EncodeStepHeader(h);
    }
    DQ_ASSIGN_OR_RETURN(out.header,
                        Peer(t_.PostSend(peer, Tag(o_.sequence, phase, step, block, kHeader), out.header_bytes), peer));
    DQ_ASSIGN_OR_RETURN(out.body,
                        Peer(t_.PostSend(peer, Tag(o_.sequence, phase, step, block, kPayload), payload), peer));
    out.peer = peer;
    result_.bytes_sent += kStepHeaderBytes + payload.size();
    if (phase == Phase::kStats) result_.stats_bytes_sent += kStepHeaderBytes + payload.size();
    return absl::OkStatus();
  }

  // Waits until the message (phase, step, block) has left (its payload may then be reused); no-op
  // when none was sent.
  absl::Status WaitSent(Phase phase, uint32_t step, uint32_t block) {
    auto it = outgoing_.find(Key(phase, step, block));
    if (it == outgoing_.end()) return absl::OkStatus();
    DQ_RETURN_IF_ERROR(Peer(t_.Wait(it->second.header, deadline_), it->second.peer));
    DQ_RETURN_IF_ERROR(Peer(t_.Wait(it->second.body, deadline_), it->second.peer));
    outgoing_.erase(it);
    return absl::OkStatus();
  }

  // Waits for the posted message (phase, step, block) and checks it (see the class comment). The
  // payload stays valid until Release.
  absl::StatusOr<absl::Span<const uint8_t>> Receive(Phase phase, uint32_t step, uint32_t block, const Codec& codec) {
    DQ_RETURN_IF_ERROR(Announce(phase, step, block, codec));
    Incoming& in = incoming_.at(Key(phase, step, block));
    const int peer = in.peer;
    DQ_RETURN_IF_ERROR(Peer(t_.Wait(in.body, deadline_), peer));
    const absl::Span<const uint8_t> payload(in.payload.data(), in.decoded.payload_bytes);
    result_.bytes_received += kStepHeaderBytes + payload.size();
    // Verified before anything decodes it.
    if (o_.authenticator != nullptr) {
      if (!o_.authenticator->Verify(in.header_bytes, static_cast<uint32_t>(t_.rank()), payload)) {
        return absl::UnauthenticatedError(absl::StrCat(
            "authentication failed: the message from rank ", peer, " at step ", step, " block ", block,
            " has a bad MAC (a different cluster secret, or altered in transit); its payload was not decoded"));
      }
    } else if (PayloadChecksum(payload) != in.decoded.checksum) {
      return absl::DataLossError(absl::StrCat("payload from rank ", peer, " at step ", step, " block ", block,
                                              " failed its checksum (corrupted in transit)"));
    }
    in.received = true;
    t_.MessageReceived(peer, kStepHeaderBytes + payload.size());
    return payload;
  }

  // Hands a received payload's buffer back.
  void Release(Phase phase, uint32_t step, uint32_t block) {
    auto it = incoming_.find(Key(phase, step, block));
    if (it == incoming_.end() || !it->second.received) return;
    pool_.Give(std::move(it->second.payload));
    incoming_.erase(it);
  }

 private:
  StepHeader Expected(Phase phase, uint32_t step, size_t block, const Codec& codec, int sender) const {
    StepHeader h;
    h.phase = phase;
    h.codec = static_cast<uint8_t>(codec.id());
    h.bits_x1000 = BitsX1000(codec);
    h.sender = static_cast<uint32_t>(sender);
    h.job_id = o_.job_id;
    h.config_epoch = o_.config_epoch;
    h.sequence = o_.sequence;
    h.step = step;
    h.block = static_cast<uint32_t>(block);
    return h;
  }
  // Both sides of a link must authenticate, or neither.
  absl::Status CheckAuthenticationMode(const StepHeader& received, int peer) const {
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
    return absl::Status(s.code(), absl::StrCat("from rank ", peer, ": ", s.message()));
  }

  struct Incoming {
    int peer = -1;
    uint64_t tag = 0;  // the payload's
    size_t max_bytes = 0;
    std::array<uint8_t, kStepHeaderBytes> header_bytes{};
    StepHeader decoded;  // once announced
    Bytes payload;       // the announced size (or the bound, when trusted), from the pool
    Transport::Handle header = 0, body = 0;
    bool payload_posted = false, announced = false, received = false;
  };
  struct Outgoing {
    int peer = -1;
    std::array<uint8_t, kStepHeaderBytes> header_bytes{};
    Transport::Handle header = 0, body = 0;
  };
  absl::Status PostPayload(Incoming& in, size_t bytes) {
    in.payload = pool_.Take(bytes);
    in.payload.resize(bytes);
    DQ_ASSIGN_OR_RETURN(in.body, Peer(t_.PostRecv(in.peer, in.tag, absl::MakeSpan(in.payload)), in.peer));
    in.payload_posted = true;
    return absl::OkStatus();
  }
  static uint64_t Key(Phase phase, uint32_t step, size_t block) {
    return (static_cast<uint64_t>(phase) << 60) | (static_cast<uint64_t>(step) << 32) | block;
  }

  Transport& t_;
  const AllReduceOptions& o_;
  BufferPool& pool_;
  // Node-based maps: posted buffers never move.
  std::map<uint64_t, Incoming> incoming_;
  std::map<uint64_t, Outgoing> outgoing_;
  std::set<int> trusted_;  // peers whose header matched
  absl::Time deadline_;
  AllReduceResult& result_;
};

// Runs reduce-scatter and all-gather for every block's executor, pipelined across blocks and steps
// as a wavefront: block k's message of step g is decoded at index g + k + 1, where block k's next
// message leaves; block k's first message is compressed and sent at index k. Each index mixes one
// block's first compression with the re-quantizations of older blocks and the decoding of
// finished ones, so the CPU work is spread evenly over the collective; doing every block's first
// step first made the CPU (shared by ranks and by the kernel's network stack) the bottleneck of
// the first step, and left the link idle (scripts/bench-network, dynamiq-ring-5: 0.141-0.146 s
// instead of 0.145-0.152 s; butterfly 0.143 s instead of 0.158 s).
// Deadlock-free: the messages decoded at index i leave their senders at index i - 1. At the start
// of index i a rank announces (Runner::Announce) the messages it decodes at index i; during it, it
// waits only for those and for its own messages sent at index i - 1 to leave, which their
// receivers take once they have started index i. Planning a block (make) may wait for statistics
// sums, which every rank sent before the blocks started. So every rank completes index i once
// every rank has completed index i - 1. Receives are posted two indices ahead (a block's first two
// when it is planned, an index before its first message is sent), so the payloads of trusted peers
// flow without waiting for this rank.
absl::Status RunExecutors(Runner& runner, const Codec& codec, const Schedule& schedule, size_t num_blocks,
                          const std::function<absl::StatusOr<std::unique_ptr<RankExecutor>>(size_t)>& make) {
  const size_t rs_steps = schedule.reduce_scatter.size(), steps = rs_steps + schedule.all_gather.size();
  // Step g of the whole collective: reduce-scatter steps first (numbered from 0 on the wire), then
  // all-gather steps (from n).
  const auto phase = [&](size_t g) { return g < rs_steps ? Phase::kReduceScatter : Phase::kAllGather; };
  const auto wire_step = [&](size_t g) {
    return static_cast<uint32_t>(g < rs_steps ? g : schedule.world_size + (g - rs_steps));
  };
  std::vector<std::unique_ptr<RankExecutor>> blocks(num_blocks);
  const auto local_step = [&](size_t g) { return static_cast<int>(g < rs_steps ? g : g - rs_steps); };
  // Peers depend on the step only.
  const auto recv_peer = [&](size_t g) {
    return g < rs_steps ? blocks[0]->ReduceScatterRecvPeer(local_step(g)) : blocks[0]->AllGatherRecvPeer(local_step(g));
  };
  const auto post = [&](size_t g, size_t k) -> absl::Status {
    RankExecutor& x = *blocks[k];
    const int peer = recv_peer(g);
    if (peer < 0) return absl::OkStatus();
    const int chunk = g < rs_steps ? x.ReduceScatterRecvChunk(local_step(g)) : x.AllGatherRecvChunk(local_step(g));
    return runner.PostReceive(phase(g), wire_step(g), static_cast<uint32_t>(k), peer, x.MaxMessageBytes(chunk));
  };
  // Calls fn(g, k) for every message of step g of block k decoded at index i.
  const auto for_index = [&](size_t i, auto&& fn) -> absl::Status {
    for (size_t g = 0; g < steps && g < i; ++g) {
      if (i - 1 - g < num_blocks) DQ_RETURN_IF_ERROR(fn(g, i - 1 - g));
    }
    return absl::OkStatus();
  };
  // Posts the payload receives of an untrusted peer's messages decoded at index i, once each
  // header checks out (a trusted peer's are posted with their headers).
  const auto announce = [&](size_t i) {
    return for_index(i, [&](size_t g, size_t k) -> absl::Status {
      if (recv_peer(g) < 0 || runner.Trusts(recv_peer(g))) return absl::OkStatus();
      return runner.Announce(phase(g), wire_step(g), static_cast<uint32_t>(k), codec);
    });
  };
  std::vector<bool> finished(blocks.size(), false);
  // Block k's message of step g, if it sends one (after its reduce-scatter, once, the owned chunk
  // is final and decoded).
  const auto send = [&](size_t g, size_t k) -> absl::Status {
    RankExecutor& x = *blocks[k];
    if (g >= rs_steps && !finished[k]) {
      DQ_RETURN_IF_ERROR(x.FinishReduceScatter());
      finished[k] = true;
    }
    const int s = local_step(g);
    const int peer = g < rs_steps ? x.ReduceScatterSendPeer(s) : x.AllGatherSendPeer(s);
    if (peer < 0) return absl::OkStatus();
    DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> bytes, g < rs_steps ? x.ReduceScatterSend(s) : x.AllGatherSend(s));
    return runner.Send(phase(g), wire_step(g), static_cast<uint32_t>(k), peer, codec, bytes);
  };
  // Decodes block k's message of step g (if it receives one) and sends its next.
  const auto advance = [&](size_t g, size_t k) -> absl::Status {
    RankExecutor& x = *blocks[k];
    const uint32_t block = static_cast<uint32_t>(k);
    if (recv_peer(g) >= 0) {
      DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> payload, runner.Receive(phase(g), wire_step(g), block, codec));
      const int s = local_step(g);
      DQ_RETURN_IF_ERROR(g < rs_steps ? x.ReduceScatterReceive(s, payload) : x.AllGatherReceive(s, payload));
      runner.Release(phase(g), wire_step(g), block);
    }
    // The executor reuses the buffer of this step's message for the next one.
    DQ_RETURN_IF_ERROR(runner.WaitSent(phase(g), wire_step(g), block));
    return g + 1 < steps ? send(g + 1, k) : absl::OkStatus();
  };
  if (steps == 0) {  // one rank: nothing moves
    for (size_t k = 0; k < num_blocks; ++k) {
      DQ_ASSIGN_OR_RETURN(blocks[k], make(k));
      DQ_RETURN_IF_ERROR(blocks[k]->FinishReduceScatter());
    }
    return absl::OkStatus();
  }
  // Block k is planned (and its first two steps' receives posted) one index before its first
  // message is sent, so a peer's first message of it never waits for this rank to catch up.
  const auto plan = [&](size_t k) -> absl::Status {
    if (k >= num_blocks) return absl::OkStatus();
    DQ_ASSIGN_OR_RETURN(blocks[k], make(k));
    for (size_t g = 0; g < std::min<size_t>(steps, 2); ++g) DQ_RETURN_IF_ERROR(post(g, k));
    return absl::OkStatus();
  };
  // Index 0: block 0 leaves first. Then the first header is checked: until a peer's first header
  // checks out, its payloads wait for Announce (and Gloo moves nothing before the receive is
  // posted), so its link would idle.
  DQ_RETURN_IF_ERROR(plan(0));
  DQ_RETURN_IF_ERROR(send(0, 0));
  DQ_RETURN_IF_ERROR(announce(1));
  DQ_RETURN_IF_ERROR(plan(1));
  for (size_t i = 1; i < steps + num_blocks; ++i) {
    DQ_RETURN_IF_ERROR(announce(i));
    if (i < num_blocks) DQ_RETURN_IF_ERROR(send(0, i));
    DQ_RETURN_IF_ERROR(plan(i + 1));
    // Receives of index i + 2.
    DQ_RETURN_IF_ERROR(for_index(i + 2, [&](size_t g, size_t k) { return g >= 2 ? post(g, k) : absl::OkStatus(); }));
    DQ_RETURN_IF_ERROR(for_index(i, advance));
  }
  for (size_t k = 0; k < blocks.size(); ++k) {
    if (!finished[k]) DQ_RETURN_IF_ERROR(blocks[k]->FinishReduceScatter());
  }
  return absl::OkStatus();
}

// The maxima statistics (THC): a ring all-gather of every rank's raw statistics into `reduced`.
absl::Status AllGatherMaxima(Runner& runner, const Codec& codec, int rank, int n, const std::vector<float>& local,
                             std::vector<float>& reduced) {
  reduced = local;
  std::vector<uint8_t> forward(local.size() * sizeof(float));
  std::memcpy(forward.data(), local.data(), forward.size());
  const int left = (rank + n - 1) % n, right = (rank + 1) % n;
  for (uint32_t s = 0; s + 1 < static_cast<uint32_t>(n); ++s) {
    DQ_RETURN_IF_ERROR(runner.PostReceive(Phase::kStats, s, 0, left, forward.size()));
    DQ_RETURN_IF_ERROR(runner.Send(Phase::kStats, s, 0, right, codec, forward));
    DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> bytes, runner.Receive(Phase::kStats, s, 0, codec));
    if (bytes.size() != forward.size()) {
      return absl::InvalidArgumentError(absl::StrCat("statistics size mismatch from rank ", left));
    }
    std::vector<uint8_t> next(bytes.begin(), bytes.end());
    runner.Release(Phase::kStats, s, 0);
    DQ_RETURN_IF_ERROR(runner.WaitSent(Phase::kStats, s, 0));
    std::vector<float> values(local.size());
    std::memcpy(values.data(), next.data(), next.size());
    for (size_t i = 0; i < local.size(); ++i) {
      reduced[i] = std::max(reduced[i], values[i]);
      if (std::isnan(values[i])) reduced[i] = values[i];
    }
    forward = std::move(next);
  }
  return absl::OkStatus();
}

// DynamiQ's statistics: the direct exchange of engine/stats_exchange.h, overlapped with computing
// them and with the start of the pipeline. Start computes the local statistics chunk by chunk in
// the order they leave (chunk rank + 1 first, this rank's own last), so each is on the wire while
// the next is computed; then sums this rank's chunk and sends the sum to every rank. Await waits
// only for the owners' sums a block's plan needs, so block 0 leaves before the last sum is in.
// The message from rank q to rank p in round j is (kStats, step j * n + q, block p): unique among
// this rank's sends and among its receives. Lives longer than the Runner: its buffers back sends.
class SumStatsExchange {
 public:
  SumStatsExchange(const Codec& codec, const Codec& header_codec, int rank, int n, size_t num_elements)
      : codec_(codec),
        header_codec_(header_codec),
        rank_(rank),
        n_(n),
        d_(num_elements),
        local_(codec.StatsLength(num_elements)),
        reduced_(local_.size()),
        parts_(n),
        have_(n, false) {}

  absl::Span<const float> local() const { return local_; }
  absl::Span<const float> reduced() const { return reduced_; }

  absl::Status Start(Runner& runner, const kernels::Source& raw) {
    // The parts of this rank's chunk, and every other owner's sum.
    const size_t mine = Chunk(rank_).count;
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      DQ_RETURN_IF_ERROR(runner.PostReceive(Phase::kStats, Step(0, q), Block(rank_), q, 2 * mine));
      DQ_RETURN_IF_ERROR(runner.PostReceive(Phase::kStats, Step(1, q), Block(rank_), q, 2 * Chunk(q).count));
    }
    // 1. Chunk p of the local statistics to rank p, as soon as it is computed.
    const size_t elem = kernels::DTypeSize(raw.dtype);
    for (int i = 1; i <= n_; ++i) {
      const int p = (rank_ + i) % n_;
      const kernels::ChunkRef c = Chunk(p);
      // Two statistics per super-group; chunks hold whole super-groups (ChunkOf rounds to 256).
      const size_t begin = c.begin / 2 * kernels::kSuperGroupSize;
      const size_t end = std::min(d_, (c.begin + c.count) / 2 * kernels::kSuperGroupSize);
      if (end > begin) {
        kernels::Source part = raw;
        part.data = static_cast<const uint8_t*>(raw.data) + (begin - raw.first) * elem;
        part.first = 0;
        codec_.ComputeStats(part, end - begin, local_.data() + c.begin);
      }
      parts_[p] = EncodeStatsBf16(absl::MakeConstSpan(local_).subspan(c.begin, c.count));
      if (p != rank_) {
        DQ_RETURN_IF_ERROR(runner.Send(Phase::kStats, Step(0, rank_), Block(p), p, header_codec_, parts_[p]));
      }
    }
    // Every peer's payload receive is posted once its header checks out (Runner::Announce), before
    // this rank waits for any payload: the contributions then arrive in parallel.
    for (int q = 0; q < n_; ++q) {
      if (q != rank_) DQ_RETURN_IF_ERROR(runner.Announce(Phase::kStats, Step(0, q), Block(rank_), header_codec_));
    }
    std::vector<absl::Span<const uint8_t>> contributions(n_);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) {
        contributions[q] = parts_[q];
      } else {
        DQ_ASSIGN_OR_RETURN(contributions[q], runner.Receive(Phase::kStats, Step(0, q), Block(rank_), header_codec_));
      }
    }
    DQ_ASSIGN_OR_RETURN(sum_, SumStatsBf16(contributions, 2 * mine));
    for (int q = 0; q < n_; ++q) {
      if (q != rank_) runner.Release(Phase::kStats, Step(0, q), Block(rank_));
    }
    // 2. This rank's sum to every rank.
    for (int p = 0; p < n_; ++p) {
      if (p != rank_) DQ_RETURN_IF_ERROR(runner.Send(Phase::kStats, Step(1, rank_), Block(p), p, header_codec_, sum_));
    }
    have_[rank_] = true;
    return DecodeStatsBf16(sum_, absl::MakeSpan(reduced_).subspan(Chunk(rank_).begin, mine));
  }

  // Waits until the reduced statistics [offset, offset + length) are here.
  absl::Status Await(Runner& runner, size_t offset, size_t length) {
    for (int p = 0; p < n_; ++p) {
      const kernels::ChunkRef c = Chunk(p);
      if (c.count > 0 && c.begin < offset + length && offset < c.begin + c.count) DQ_RETURN_IF_ERROR(Take(runner, p));
    }
    return absl::OkStatus();
  }

  // Takes every sum still to come (empty chunks too) and waits until this rank's sends are out.
  absl::Status Finish(Runner& runner) {
    for (int p = 0; p < n_; ++p) DQ_RETURN_IF_ERROR(Take(runner, p));
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      DQ_RETURN_IF_ERROR(runner.WaitSent(Phase::kStats, Step(0, rank_), Block(p)));
      DQ_RETURN_IF_ERROR(runner.WaitSent(Phase::kStats, Step(1, rank_), Block(p)));
    }
    return absl::OkStatus();
  }

 private:
  kernels::ChunkRef Chunk(int p) const { return ChunkOf(local_.size(), n_, p); }
  uint32_t Step(int round, int sender) const { return static_cast<uint32_t>(round * n_ + sender); }
  static uint32_t Block(int receiver) { return static_cast<uint32_t>(receiver); }

  // Rank p's sum of chunk p, decoded into the reduced statistics.
  absl::Status Take(Runner& runner, int p) {
    if (have_[p]) return absl::OkStatus();
    const kernels::ChunkRef c = Chunk(p);
    DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> bytes,
                        runner.Receive(Phase::kStats, Step(1, p), Block(rank_), header_codec_));
    absl::Status decoded = DecodeStatsBf16(bytes, absl::MakeSpan(reduced_).subspan(c.begin, c.count));
    runner.Release(Phase::kStats, Step(1, p), Block(rank_));
    if (!decoded.ok()) return absl::InvalidArgumentError(absl::StrCat("from rank ", p, ": ", decoded.message()));
    have_[p] = true;
    return absl::OkStatus();
  }

  const Codec& codec_;
  const Codec& header_codec_;
  const int rank_, n_;
  const size_t d_;
  std::vector<float> local_, reduced_;
  std::vector<std::vector<uint8_t>> parts_;  // round 1: chunk p for rank p
  std::vector<uint8_t> sum_;                 // round 2
  std::vector<bool> have_;                   // per chunk: its sum decoded
};

absl::StatusOr<AllReduceResult> AllReduceImpl(const Codec& codec, Transport& transport, const AllReduceOptions& options,
                                              const kernels::Source& local, const kernels::Dest& out, size_t d) {
  const int n = transport.size();
  const int rank = transport.rank();
  DQ_ASSIGN_OR_RETURN(Schedule schedule, MakeSchedule(options.topology, n));
  if (options.topology == Topology::kButterfly && !codec.SupportsButterfly()) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", kernels::CodecName(codec.id()), " does not support the butterfly topology"));
  }
  if (d > (size_t{1} << 40)) return absl::InvalidArgumentError(absl::StrCat("bucket of ", d, " elements is too large"));
  const size_t block = BlockElements(d, options.block_elements);
  DQ_ASSIGN_OR_RETURN(const size_t num_blocks, NumBlocks(d, options.block_elements));
  AllReduceResult result;
  result.blocks = static_cast<int>(num_blocks);
  const absl::Time deadline = absl::Now() + options.timeout;
  const size_t stats_len = codec.StatsLength(d);
  const bool per_block = PlansPerBlock(codec) && stats_len > 0;
  // Whatever a posted send may read outlives the runner, which aborts the transport when the
  // collective fails with operations still posted: the pool (executors give their buffers back to
  // it) and the statistics.
  BufferPool call_pool;
  BufferPool& pool = options.buffers != nullptr ? *options.buffers : call_pool;
  std::unique_ptr<Codec> bf16;  // names the statistics messages' codec
  std::optional<SumStatsExchange> sums;
  if (per_block) {
    kernels::CodecConfig bf16_config;
    bf16_config.id = kernels::CodecId::kBf16;
    DQ_ASSIGN_OR_RETURN(bf16, kernels::CreateCodec(bf16_config));
    sums.emplace(codec, *bf16, rank, n, d);
  }
  std::vector<float> local_stats, reduced_stats;
  Runner runner(transport, options, pool, deadline, result);

  // 1. Statistics (of the values as they are; the plan's centring applies to compression only),
  // and a whole-bucket plan for codecs that do not plan per block.
  kernels::Source raw = local;
  raw.subtract_per_group = nullptr;
  BucketPlan bucket_plan;
  if (per_block) {
    DQ_RETURN_IF_ERROR(Annotate(sums->Start(runner, raw), rank));
  } else {
    local_stats.resize(stats_len);
    if (stats_len > 0) {
      codec.ComputeStats(raw, d, local_stats.data());
      DQ_RETURN_IF_ERROR(Annotate(AllGatherMaxima(runner, codec, rank, n, local_stats, reduced_stats), rank));
    }
    const kernels::RoundInfo round{options.sequence, static_cast<uint32_t>(rank), static_cast<uint32_t>(n)};
    DQ_ASSIGN_OR_RETURN(bucket_plan, codec.MakePlan(round, d, local_stats, reduced_stats));
  }

  // 2. Blocks, each with its plan (engine/block_plan.h), made as the pipeline starts.
  std::vector<BucketPlan> plans(num_blocks);
  const size_t elem = kernels::DTypeSize(local.dtype), out_elem = kernels::DTypeSize(out.dtype);
  const auto make = [&](size_t k) -> absl::StatusOr<std::unique_ptr<RankExecutor>> {
    const size_t begin = k * block, count = std::min(block, d - begin);
    BucketPlan& p = plans[k];
    if (per_block) {
      const BlockStats range = BlockStatsRange(codec, d, block, k);
      DQ_RETURN_IF_ERROR(sums->Await(runner, range.offset, range.length));
      DQ_ASSIGN_OR_RETURN(p, codec.MakePlan(BlockRound(options.sequence, k, rank, n), count,
                                            sums->local().subspan(range.offset, range.length),
                                            sums->reduced().subspan(range.offset, range.length)));
    } else {
      p = SliceBucketPlan(bucket_plan, options.sequence, k, begin, count);
    }
    kernels::Source src{static_cast<const uint8_t*>(local.data) + (begin - local.first) * elem, local.dtype, 0,
                        p.local_means.empty() ? nullptr : p.local_means.data()};
    kernels::Dest dst{static_cast<uint8_t*>(out.data) + (begin - out.first) * out_elem, out.dtype, 0,
                      p.mean_sums.empty() ? nullptr : p.mean_sums.data()};
    return std::make_unique<RankExecutor>(codec, schedule, p, src, dst, &pool);
  };

  // 3. Reduce-scatter and all-gather, as a wavefront over blocks and steps.
  DQ_RETURN_IF_ERROR(Annotate(RunExecutors(runner, codec, schedule, num_blocks, make), rank));
  if (per_block) DQ_RETURN_IF_ERROR(Annotate(sums->Finish(runner), rank));
  return result;
}

}  // namespace

absl::StatusOr<AllReduceResult> AllReduce(const Codec& codec, Transport& transport, const AllReduceOptions& options,
                                          const kernels::Source& local, const kernels::Dest& out, size_t d) {
  absl::StatusOr<AllReduceResult> result = AllReduceImpl(codec, transport, options, local, out, d);
  // A failed collective may leave receives posted into buffers that die with it: abort the
  // transport (it is broken for this group anyway) so nothing writes into them later.
  if (!result.ok()) transport.Abort();
  return result;
}

}  // namespace dynamiq::engine
