#include "engine/allreduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/block_plan.h"
#include "engine/rank_executor.h"
#include "engine/side_lane.h"
#include "engine/stats_exchange.h"
#include "engine/step_header.h"
#include "engine/step_messenger.h"
#include "engine/topology_selector.h"
#include "kernels/codec_registry.h"
#include "kernels/cpu/bucket_transform.h"
#include "kernels/dtype.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::engine {
namespace {

using kernels::BucketPlan;
using kernels::Codec;

// Prefixes an error with this rank's identity (keeps the code and payloads).
absl::Status Annotate(const absl::Status& s, int rank) { return common::Annotate(s, absl::StrCat("rank ", rank)); }

// Runs reduce-scatter and all-gather for every block's executor, pipelined across blocks and steps
// as a wavefront: block k's messages of step g are decoded at index g + k + 1, where block k's
// messages of step g + 1 leave; block k's first messages are compressed and sent at index k. Each
// index mixes one block's first compression with the re-quantizations of older blocks and the
// decoding of finished ones, so the CPU work is spread evenly over the collective; doing every
// block's first step first made the CPU (shared by ranks and by the kernel's network stack) the
// bottleneck of the first step, and left the link idle (scripts/bench-network, dynamiq-ring-5:
// 0.141-0.146 s instead of 0.145-0.152 s; butterfly 0.143 s instead of 0.158 s).
// Within an index a message leaves as soon as its chunk is ready (RankExecutor::*SendReady): step
// g + 1's sends that need nothing of step g (leaves, chunks complete earlier) before step g's
// receives, each other one right after the receive that completed its chunk. Receives are decoded
// in the schedule's order, so a chunk's children are added in the same order on every run.
// Deadlock-free: the messages decoded at index i leave their senders at index i - 1. At the start
// of index i a rank announces (StepMessenger::Announce) the messages it decodes at index i; during
// it, it waits only for those and for its own messages sent at index i - 1 to leave, which their
// receivers take once they have started index i. Planning a block (make) may wait for statistics
// sums, which every rank sent before the blocks started. So every rank completes index i once
// every rank has completed index i - 1. Receives are posted two indices ahead (a block's first two
// when it is planned, an index before its first messages are sent), so the payloads of trusted
// peers flow without waiting for this rank.
absl::Status RunExecutors(StepMessenger& messenger, const Codec& codec, const Schedule& schedule, size_t num_blocks,
                          const std::function<absl::StatusOr<std::unique_ptr<RankExecutor>>(size_t)>& make,
                          Timeline* timeline) {
  const size_t rs_steps = schedule.reduce_scatter.size(), steps = rs_steps + schedule.all_gather.size();
  // Step g of the whole collective: reduce-scatter steps first (numbered from 0 on the wire), then
  // all-gather steps (from n).
  const auto phase = [&](size_t g) { return g < rs_steps ? Phase::kReduceScatter : Phase::kAllGather; };
  const auto wire_step = [&](size_t g) {
    return static_cast<uint32_t>(g < rs_steps ? g : schedule.world_size + (g - rs_steps));
  };
  std::vector<std::unique_ptr<RankExecutor>> blocks(num_blocks);
  const auto local_step = [&](size_t g) { return static_cast<int>(g < rs_steps ? g : g - rs_steps); };
  // This rank's transfers of step g, the same for every block.
  const auto sends = [&](size_t g) -> const std::vector<Transfer>& {
    return g < rs_steps ? blocks[0]->ReduceScatterSends(local_step(g)) : blocks[0]->AllGatherSends(local_step(g));
  };
  const auto receives = [&](size_t g) -> const std::vector<Transfer>& {
    return g < rs_steps ? blocks[0]->ReduceScatterReceives(local_step(g)) : blocks[0]->AllGatherReceives(local_step(g));
  };
  const auto post = [&](size_t g, size_t k) -> absl::Status {
    RankExecutor& x = *blocks[k];
    const std::vector<Transfer>& in = receives(g);
    for (size_t i = 0; i < in.size(); ++i) {
      DQ_RETURN_IF_ERROR(messenger.PostReceive(
          phase(g), wire_step(g), static_cast<uint32_t>(k), in[i].from, x.MaxMessageBytes(in[i].chunk),
          g < rs_steps ? absl::Span<uint8_t>() : x.AllGatherRecvBody(local_step(g), static_cast<int>(i))));
    }
    return absl::OkStatus();
  };
  // Calls fn(g, k) for every step g of block k whose messages are decoded at index i.
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
      for (const Transfer& t : receives(g)) {
        if (!messenger.Trusts(t.from)) {
          DQ_RETURN_IF_ERROR(messenger.Announce(phase(g), wire_step(g), static_cast<uint32_t>(k), t.from, codec));
        }
      }
      return absl::OkStatus();
    });
  };
  std::vector<bool> finished(blocks.size(), false);
  // Per block, the step whose sends are under way and which of them have left.
  struct Sending {
    size_t step = SIZE_MAX;
    std::vector<bool> sent;
  };
  std::vector<Sending> sending(num_blocks);
  // Sends block k's messages of step g that are ready and not sent yet, in the schedule's order.
  // With `all` (step g - 1's receives are in), every one must be ready, and after the all-gather's
  // first sends (they need only the owned chunk's final bytes) the owner decodes its chunk.
  const auto send = [&](size_t g, size_t k, bool all) -> absl::Status {
    RankExecutor& x = *blocks[k];
    const uint32_t block = static_cast<uint32_t>(k);
    const bool rs = g < rs_steps;
    const int s = local_step(g);
    const std::vector<Transfer>& out = sends(g);
    Sending& state = sending[k];
    if (state.step != g) {
      state.step = g;
      state.sent.assign(out.size(), false);
    }
    for (size_t j = 0; j < out.size(); ++j) {
      const int i = static_cast<int>(j);
      if (state.sent[j]) continue;
      if (!(rs ? x.ReduceScatterSendReady(s, i) : x.AllGatherSendReady(s, i))) {
        if (!all) continue;
        return absl::InternalError(absl::StrCat("block ", k, ": the message of step ", wire_step(g), " to rank ",
                                                out[j].to, " is not ready after the step before"));
      }
      std::optional<TimelineSpan> span;
      if (rs && x.ReduceScatterSendCompresses(s, i)) span.emplace(timeline, Timeline::Kind::kCompress, block);
      DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> bytes, rs ? x.ReduceScatterSend(s, i) : x.AllGatherSend(s, i));
      span.reset();
      DQ_RETURN_IF_ERROR(
          messenger.Send(phase(g), wire_step(g), block, out[j].to, codec, bytes, x.SentChecksum(), x.SentBody()));
      state.sent[j] = true;
    }
    if (all && g == rs_steps && !finished[k]) {
      TimelineSpan span(timeline, Timeline::Kind::kDecompress, block);
      DQ_RETURN_IF_ERROR(x.FinishReduceScatter());
      finished[k] = true;
    }
    return absl::OkStatus();
  };
  // Decodes block k's messages of step g and sends its next ones as they become ready.
  const auto advance = [&](size_t g, size_t k) -> absl::Status {
    RankExecutor& x = *blocks[k];
    const uint32_t block = static_cast<uint32_t>(k);
    const int s = local_step(g);
    const bool next = g + 1 < steps;
    if (next) DQ_RETURN_IF_ERROR(send(g + 1, k, false));
    const std::vector<Transfer>& in = receives(g);
    for (size_t i = 0; i < in.size(); ++i) {
      const int peer = in[i].from;
      // Without an authenticator the executor verifies each payload's checksum as it decodes it.
      std::optional<uint64_t> unverified;
      DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> payload,
                          messenger.Receive(phase(g), wire_step(g), block, peer, codec, &unverified));
      {
        TimelineSpan span(timeline, g < rs_steps ? Timeline::Kind::kDar : Timeline::Kind::kDecompress, block);
        if (g < rs_steps) {
          DQ_RETURN_IF_ERROR(x.ReduceScatterReceive(s, static_cast<int>(i), payload, unverified));
          messenger.Release(phase(g), wire_step(g), block, peer);
        } else {  // the payload's buffer is forwarded as it is, with its checksum
          StepMessenger::TakenPayload taken = messenger.TakePayload(phase(g), wire_step(g), block, peer);
          DQ_RETURN_IF_ERROR(x.AllGatherReceive(s, static_cast<int>(i), std::move(taken.bytes), taken.checksum,
                                                unverified.has_value()));
        }
      }
      if (next) DQ_RETURN_IF_ERROR(send(g + 1, k, false));
    }
    // This step's messages have left: the executor reuses their buffers.
    const std::vector<Transfer>& out = sends(g);
    for (size_t j = 0; j < out.size(); ++j) {
      DQ_RETURN_IF_ERROR(messenger.WaitSent(phase(g), wire_step(g), block, out[j].to));
      if (g < rs_steps) {
        x.ReduceScatterSent(s, static_cast<int>(j));
      } else {
        x.AllGatherSent(s, static_cast<int>(j));
      }
    }
    return next ? send(g + 1, k, true) : absl::OkStatus();
  };
  if (steps == 0) {  // one rank: nothing moves
    for (size_t k = 0; k < num_blocks; ++k) {
      DQ_ASSIGN_OR_RETURN(blocks[k], make(k));
      DQ_RETURN_IF_ERROR(blocks[k]->FinishReduceScatter());
    }
    return absl::OkStatus();
  }
  // Block k is planned (and its first two steps' receives posted) one index before its first
  // messages are sent, so a peer's first message of it never waits for this rank to catch up.
  const auto plan = [&](size_t k) -> absl::Status {
    if (k >= num_blocks) return absl::OkStatus();
    DQ_ASSIGN_OR_RETURN(blocks[k], make(k));
    for (size_t g = 0; g < std::min<size_t>(steps, 2); ++g) DQ_RETURN_IF_ERROR(post(g, k));
    return absl::OkStatus();
  };
  // Index 0: block 0 leaves first. Then the first headers are checked: until a peer's first header
  // checks out, its payloads wait for Announce (and Gloo moves nothing before the receive is
  // posted), so its link would idle.
  DQ_RETURN_IF_ERROR(plan(0));
  DQ_RETURN_IF_ERROR(send(0, 0, true));
  DQ_RETURN_IF_ERROR(announce(1));
  DQ_RETURN_IF_ERROR(plan(1));
  for (size_t i = 1; i < steps + num_blocks; ++i) {
    DQ_RETURN_IF_ERROR(announce(i));
    if (i < num_blocks) DQ_RETURN_IF_ERROR(send(0, i, true));
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
absl::Status AllGatherMaxima(StepMessenger& messenger, const Codec& codec, int rank, int n,
                             const std::vector<float>& local, std::vector<float>& reduced) {
  reduced = local;
  std::vector<uint8_t> forward(local.size() * sizeof(float));
  std::memcpy(forward.data(), local.data(), forward.size());
  const int left = (rank + n - 1) % n, right = (rank + 1) % n;
  for (uint32_t s = 0; s + 1 < static_cast<uint32_t>(n); ++s) {
    DQ_RETURN_IF_ERROR(messenger.PostReceive(Phase::kStats, s, 0, left, forward.size()));
    DQ_RETURN_IF_ERROR(messenger.Send(Phase::kStats, s, 0, right, codec, forward));
    DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> bytes, messenger.Receive(Phase::kStats, s, 0, left, codec));
    if (bytes.size() != forward.size()) {
      return absl::InvalidArgumentError(absl::StrCat("statistics size mismatch from rank ", left));
    }
    std::vector<uint8_t> next(bytes.begin(), bytes.end());
    messenger.Release(Phase::kStats, s, 0, left);
    DQ_RETURN_IF_ERROR(messenger.WaitSent(Phase::kStats, s, 0, right));
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
// this rank's sends and among its receives. Lives longer than the StepMessenger: its buffers back sends.
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

  absl::Status Start(StepMessenger& messenger, const kernels::Source& raw, Timeline* timeline) {
    // The parts of this rank's chunk, and every other owner's sum.
    const size_t mine = Chunk(rank_).count;
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      DQ_RETURN_IF_ERROR(messenger.PostReceive(Phase::kStats, Step(0, q), Block(rank_), q, 2 * mine));
      DQ_RETURN_IF_ERROR(messenger.PostReceive(Phase::kStats, Step(1, q), Block(rank_), q, 2 * Chunk(q).count));
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
        TimelineSpan span(timeline, Timeline::Kind::kStats);
        codec_.ComputeStats(part, end - begin, local_.data() + c.begin);
      }
      parts_[p] = EncodeStatsBf16(absl::MakeConstSpan(local_).subspan(c.begin, c.count));
      if (p != rank_) {
        DQ_RETURN_IF_ERROR(messenger.Send(Phase::kStats, Step(0, rank_), Block(p), p, header_codec_, parts_[p]));
      }
    }
    // Every peer's payload receive is posted once its header checks out (StepMessenger::Announce), before
    // this rank waits for any payload: the contributions then arrive in parallel.
    for (int q = 0; q < n_; ++q) {
      if (q != rank_) DQ_RETURN_IF_ERROR(messenger.Announce(Phase::kStats, Step(0, q), Block(rank_), q, header_codec_));
    }
    std::vector<absl::Span<const uint8_t>> contributions(n_);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) {
        contributions[q] = parts_[q];
      } else {
        DQ_ASSIGN_OR_RETURN(contributions[q],
                            messenger.Receive(Phase::kStats, Step(0, q), Block(rank_), q, header_codec_));
      }
    }
    DQ_ASSIGN_OR_RETURN(sum_, SumStatsBf16(contributions, 2 * mine));
    for (int q = 0; q < n_; ++q) {
      if (q != rank_) messenger.Release(Phase::kStats, Step(0, q), Block(rank_), q);
    }
    // 2. This rank's sum to every rank.
    for (int p = 0; p < n_; ++p) {
      if (p != rank_)
        DQ_RETURN_IF_ERROR(messenger.Send(Phase::kStats, Step(1, rank_), Block(p), p, header_codec_, sum_));
    }
    have_[rank_] = true;
    return DecodeStatsBf16(sum_, absl::MakeSpan(reduced_).subspan(Chunk(rank_).begin, mine));
  }

  // Waits until the reduced statistics [offset, offset + length) are here.
  absl::Status Await(StepMessenger& messenger, size_t offset, size_t length) {
    for (int p = 0; p < n_; ++p) {
      const kernels::ChunkRef c = Chunk(p);
      if (c.count > 0 && c.begin < offset + length && offset < c.begin + c.count)
        DQ_RETURN_IF_ERROR(Take(messenger, p));
    }
    return absl::OkStatus();
  }

  // Takes every sum still to come (empty chunks too) and waits until this rank's sends are out.
  absl::Status Finish(StepMessenger& messenger) {
    for (int p = 0; p < n_; ++p) DQ_RETURN_IF_ERROR(Take(messenger, p));
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      DQ_RETURN_IF_ERROR(messenger.WaitSent(Phase::kStats, Step(0, rank_), Block(p), p));
      DQ_RETURN_IF_ERROR(messenger.WaitSent(Phase::kStats, Step(1, rank_), Block(p), p));
    }
    return absl::OkStatus();
  }

 private:
  kernels::ChunkRef Chunk(int p) const { return ChunkOf(local_.size(), n_, p); }
  uint32_t Step(int round, int sender) const { return static_cast<uint32_t>(round * n_ + sender); }
  static uint32_t Block(int receiver) { return static_cast<uint32_t>(receiver); }

  // Rank p's sum of chunk p, decoded into the reduced statistics.
  absl::Status Take(StepMessenger& messenger, int p) {
    if (have_[p]) return absl::OkStatus();
    const kernels::ChunkRef c = Chunk(p);
    DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> bytes,
                        messenger.Receive(Phase::kStats, Step(1, p), Block(rank_), p, header_codec_));
    absl::Status decoded = DecodeStatsBf16(bytes, absl::MakeSpan(reduced_).subspan(c.begin, c.count));
    messenger.Release(Phase::kStats, Step(1, p), Block(rank_), p);
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

absl::StatusOr<AllReduceResult> AllReduceImpl(const Codec& codec, Transport& transport,
                                              const AllReduceOptions& configured, const kernels::Source& local,
                                              const kernels::Dest& out, size_t d) {
  const int n = transport.size();
  const int rank = transport.rank();
  // topology=auto: every rank resolves it alike; the step headers carry the pick.
  AllReduceOptions options = configured;
  options.topology = SelectTopology(configured.topology, d, n, codec, transport.capabilities());
  DQ_ASSIGN_OR_RETURN(Schedule schedule, MakeSchedule(options.topology, n));
  // Butterfly and two-shot chunks have several children, summed in an fp32 accumulator.
  if (options.topology != Topology::kRing && !codec.SupportsButterfly()) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", kernels::CodecName(codec.id()), " does not support the ",
                                                   TopologyName(options.topology), " topology"));
  }
  if (d > (size_t{1} << 40)) return absl::InvalidArgumentError(absl::StrCat("bucket of ", d, " elements is too large"));
  const size_t block = BlockElements(d, options.block_elements);
  DQ_ASSIGN_OR_RETURN(const size_t num_blocks, NumBlocks(d, options.block_elements));
  AllReduceResult result;
  result.blocks = static_cast<int>(num_blocks);
  result.topology = options.topology;
  const absl::Time deadline = absl::Now() + options.timeout;
  const size_t stats_len = codec.StatsLength(d);
  const bool per_block = PlansPerBlock(codec) && stats_len > 0;
  // Whatever a posted send may read outlives the messenger, which aborts the transport when the
  // collective fails with operations still posted: the pool (executors give their buffers back to
  // it), the statistics and the side lane.
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
  // The side lane's few values travel while everything else does (engine/side_lane.h).
  std::optional<SideLane> side;
  StepMessenger messenger(transport, options, pool, deadline, result);
  if (!options.side_sums.empty()) {
    side.emplace(codec, rank, n);
    DQ_RETURN_IF_ERROR(Annotate(side->Start(messenger, options.side_sums), rank));
  }

  // 1. Statistics (of the values as they are; the plan's centring applies to compression only),
  // and a whole-bucket plan for codecs that do not plan per block.
  kernels::Source raw = local;
  raw.subtract_per_group = nullptr;
  BucketPlan bucket_plan;
  if (per_block) {
    DQ_RETURN_IF_ERROR(Annotate(sums->Start(messenger, raw, options.timeline), rank));
  } else {
    local_stats.resize(stats_len);
    if (stats_len > 0) {
      {
        TimelineSpan span(options.timeline, Timeline::Kind::kStats);
        codec.ComputeStats(raw, d, local_stats.data());
      }
      DQ_RETURN_IF_ERROR(Annotate(AllGatherMaxima(messenger, codec, rank, n, local_stats, reduced_stats), rank));
    }
    const kernels::RoundInfo round{options.sequence, static_cast<uint32_t>(rank), static_cast<uint32_t>(n),
                                   options.bits};
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
      {
        TimelineSpan span(options.timeline, Timeline::Kind::kWaitStats, static_cast<uint32_t>(k));
        DQ_RETURN_IF_ERROR(sums->Await(messenger, range.offset, range.length));
      }
      kernels::RoundInfo round = BlockRound(options.sequence, k, rank, n);
      round.bits = options.bits;
      TimelineSpan span(options.timeline, Timeline::Kind::kPlan, static_cast<uint32_t>(k));
      DQ_ASSIGN_OR_RETURN(p, codec.MakePlan(round, count, sums->local().subspan(range.offset, range.length),
                                            sums->reduced().subspan(range.offset, range.length)));
    } else {
      p = SliceBucketPlan(bucket_plan, options.sequence, k, begin, count);
    }
    kernels::Source src{static_cast<const uint8_t*>(local.data) + (begin - local.first) * elem, local.dtype, 0,
                        p.local_means.empty() ? nullptr : p.local_means.data()};
    kernels::Dest dst{static_cast<uint8_t*>(out.data) + (begin - out.first) * out_elem, out.dtype, 0,
                      p.mean_sums.empty() ? nullptr : p.mean_sums.data()};
    auto executor = std::make_unique<RankExecutor>(
        codec, schedule, p, src, dst, &pool,
        options.balanced_chunks ? BalancedChunks(codec, p, n) : std::vector<kernels::ChunkRef>{});
    // Step headers carry payload checksums (a MAC instead with an authenticator).
    if (options.authenticator == nullptr) {
      executor->ChecksumMessages();
      // none's messages keep their values where they are (no copies) where the transport can.
      if (transport.SupportsParts()) executor->UseFloat32Bodies();
    }
    return executor;
  };

  // 3. Reduce-scatter and all-gather, as a wavefront over blocks and steps.
  DQ_RETURN_IF_ERROR(Annotate(RunExecutors(messenger, codec, schedule, num_blocks, make, options.timeline), rank));
  if (per_block) DQ_RETURN_IF_ERROR(Annotate(sums->Finish(messenger), rank));
  if (side.has_value()) DQ_RETURN_IF_ERROR(Annotate(side->Finish(messenger, options.side_sums), rank));
  if (options.keep_plan_widths) {
    for (const BucketPlan& p : plans)
      result.plan_widths.insert(result.plan_widths.end(), p.widths.begin(), p.widths.end());
  }
  return result;
}

// Codecs with a whole-bucket transform (THC's rotation) all-reduce the transformed bucket, and the
// sum is transformed back after the all-gather (kernels/cpu/bucket_transform.h).
absl::StatusOr<AllReduceResult> AllReduceTransformed(const Codec& codec, Transport& transport,
                                                     const AllReduceOptions& options, const kernels::Source& local,
                                                     const kernels::Dest& out, size_t d) {
  if (!codec.NeedsBucketTransform()) return AllReduceImpl(codec, transport, options, local, out, d);
  // Keyed like block 0's plan, so that a one-block collective is the simulator's at that round.
  const kernels::RoundInfo round = BlockRound(options.sequence, 0, transport.rank(), transport.size());
  absl::StatusOr<kernels::BucketTransform> bucket = [&] {
    TimelineSpan span(options.timeline, Timeline::Kind::kCompress);
    return kernels::BucketTransform::Forward(codec, round, local, d);
  }();
  if (!bucket.ok()) return Annotate(bucket.status(), transport.rank());
  DQ_ASSIGN_OR_RETURN(AllReduceResult result,
                      AllReduceImpl(codec, transport, options, bucket->source(), bucket->dest(), bucket->size()));
  TimelineSpan span(options.timeline, Timeline::Kind::kDecompress);
  DQ_RETURN_IF_ERROR(Annotate(bucket->InverseInto(out), transport.rank()));
  return result;
}

}  // namespace

absl::StatusOr<AllReduceResult> AllReduce(const Codec& codec, Transport& transport, const AllReduceOptions& options,
                                          const kernels::Source& local, const kernels::Dest& out, size_t d) {
  absl::StatusOr<AllReduceResult> result = AllReduceTransformed(codec, transport, options, local, out, d);
  // A failed collective may leave receives posted into buffers that die with it: abort the
  // transport (it is broken for this group anyway) so nothing writes into them later.
  if (!result.ok()) transport.Abort();
  return result;
}

}  // namespace dynamiq::engine
