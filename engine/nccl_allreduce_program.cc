#include "engine/nccl_allreduce_program.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "engine/block_plan.h"
#include "engine/rank_executor.h"
#include "engine/stats_exchange.h"
#include "engine/topology_selector.h"
#include "kernels/codec_registry.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/cuda/dynamiq_cuda_host.h"
#include "kernels/dynamiq_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::engine {
namespace {

using kernels::BucketPlan;
using kernels::ChunkRef;
using kernels::Codec;
using kernels::CodecId;

constexpr uint16_t kMaxSummands = 0xffff;

bool SupportedCodec(CodecId id) { return kernels::GetCodecInfo(id).on_cuda; }

absl::Status Unsupported(const Codec& codec) {
  return absl::UnimplementedError(absl::StrCat("the NCCL all-reduce supports the ", kernels::CudaCodecNames(),
                                               " codecs, not ", kernels::CodecName(codec.id())));
}

absl::Status Annotate(const absl::Status& s, int rank) { return common::Annotate(s, absl::StrCat("rank ", rank)); }

// The protocol posts one send and one receive per rank, step and block (one NCCL group): a schedule
// with more (the two-shot) is refused before anything moves, naming it (engine/schedule.h).
absl::Status CheckNcclSchedule(const Schedule& schedule) {
  const absl::Status valid = ValidateSchedule(schedule, kNcclStepLimits);
  if (valid.ok()) return valid;
  if (valid.code() != absl::StatusCode::kInvalidArgument) return valid;
  return absl::UnimplementedError(absl::StrCat("the NCCL all-reduce runs one send and one receive per rank and step, ",
                                               "so not the ", TopologyName(schedule.topology), " schedule (",
                                               valid.message(), "); use ring or butterfly"));
}

// Transport tags only label NCCL's error messages (NCCL matches by order): phase 0 handshake and
// statistics, 1 reduce-scatter, 2 all-gather.
uint64_t Tag(uint64_t sequence, uint32_t phase, uint32_t step, uint32_t block) {
  return ((sequence & 0xffffff) << 40) | (static_cast<uint64_t>(phase & 3) << 38) |
         (static_cast<uint64_t>(step & 0xffff) << 22) | static_cast<uint64_t>(block & 0x3fffff);
}

uint16_t NextSummands(uint16_t received) { return received == kMaxSummands ? received : received + 1; }

template <typename T>
void Append(std::vector<uint8_t>& out, T value) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

// Moves the messages of one collective and remembers whether the transport failed.
class Mover {
 public:
  Mover(Transport& transport, absl::Time deadline, AllReduceResult& result)
      : t_(transport), deadline_(deadline), result_(result) {}

  // Posts the send (send_peer >= 0) and the receive (recv_peer >= 0) of one step, then waits for
  // both; on NCCL they form one group. Any transport failure aborts the transport.
  absl::Status Exchange(int send_peer, absl::Span<const uint8_t> send, int recv_peer, absl::Span<uint8_t> recv,
                        uint64_t tag, bool stats) {
    Transport::Handle send_handle = 0, recv_handle = 0;
    if (send_peer >= 0) {
      absl::StatusOr<Transport::Handle> h = t_.PostSend(send_peer, tag, send);
      if (!h.ok()) return Failed(h.status(), "posting the send to", send_peer);
      send_handle = *h;
    }
    if (recv_peer >= 0) {
      absl::StatusOr<Transport::Handle> h = t_.PostRecv(recv_peer, tag, recv);
      if (!h.ok()) return Failed(h.status(), "posting the receive from", recv_peer);
      recv_handle = *h;
    }
    if (recv_peer >= 0) {
      absl::Status s = t_.Wait(recv_handle, deadline_);
      if (!s.ok()) return Failed(s, "receiving from", recv_peer);
      result_.bytes_received += recv.size();
    }
    if (send_peer >= 0) {
      absl::Status s = t_.Wait(send_handle, deadline_);
      if (!s.ok()) return Failed(s, "sending to", send_peer);
      result_.bytes_sent += send.size();
      if (stats) result_.stats_bytes_sent += send.size();
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Failed(const absl::Status& s, absl::string_view what, int peer) {
    t_.Abort();
    return common::Annotate(s, absl::StrCat(what, " rank ", peer));
  }

  Transport& t_;
  absl::Time deadline_;
  AllReduceResult& result_;
};

// A host message through the backend's staging buffers.
absl::Status ExchangeHost(NcclAllReduceBackend& backend, Mover& mover, int send_peer, absl::Span<const uint8_t> send,
                          int recv_peer, absl::Span<uint8_t> recv, uint64_t tag) {
  absl::Span<const uint8_t> wire_send;
  absl::Span<uint8_t> wire_recv;
  if (send_peer >= 0) {
    DQ_ASSIGN_OR_RETURN(wire_send, backend.StageSend(send));
  }
  if (recv_peer >= 0) {
    DQ_ASSIGN_OR_RETURN(wire_recv, backend.StageRecv(recv.size()));
  }
  DQ_RETURN_IF_ERROR(mover.Exchange(send_peer, wire_send, recv_peer, wire_recv, tag, /*stats=*/true));
  if (recv_peer >= 0) DQ_RETURN_IF_ERROR(backend.Unstage(wire_recv, recv));
  return absl::OkStatus();
}

absl::Status Handshake(const Codec& codec, Transport& transport, const AllReduceOptions& options, size_t d,
                       NcclAllReduceBackend& backend, Mover& mover) {
  const int n = transport.size(), rank = transport.rank();
  if (n == 1) return absl::OkStatus();
  const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  const StepHeader mine = NcclHandshakeHeader(codec, options, d, rank);
  const std::array<uint8_t, kStepHeaderBytes> out = EncodeStepHeader(mine);
  std::array<uint8_t, kStepHeaderBytes> in{};
  DQ_RETURN_IF_ERROR(ExchangeHost(backend, mover, next, out, prev, absl::MakeSpan(in), Tag(options.sequence, 0, 0, 0)));
  absl::StatusOr<StepHeader> theirs = DecodeStepHeader(in);
  if (!theirs.ok()) {
    return common::Annotate(theirs.status(), absl::StrCat("handshake from rank ", prev));
  }
  const StepHeader expected = NcclHandshakeHeader(codec, options, d, prev);
  DQ_RETURN_IF_ERROR(MatchStepHeader(*theirs, expected));
  if (theirs->payload_bytes != expected.payload_bytes || theirs->block != expected.block ||
      theirs->checksum != expected.checksum) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", prev, " runs the same collective with a different bucket or configuration (its bucket has ",
        theirs->payload_bytes, " elements mod 2^32 in ", theirs->block, " blocks, this rank's ", expected.payload_bytes,
        " in ", expected.block, "; or topology, codec settings or seed differ): the message sizes would not match"));
  }
  return absl::OkStatus();
}

// The statistics all-reduce of engine::AllReduce, the direct exchange of engine/stats_exchange.h,
// as n - 1 pairwise exchanges per round (NCCL matches sends and receives pair by pair): in
// exchange i this rank sends to rank + i and receives from rank - i.
absl::Status ReduceSumStats(Transport& transport, const AllReduceOptions& options, absl::Span<const float> local,
                            absl::Span<float> reduced, NcclAllReduceBackend& backend, Mover& mover) {
  const int n = transport.size(), rank = transport.rank();
  const auto chunk = [&](int p) { return ChunkOf(local.size(), n, p); };
  const size_t mine = chunk(rank).count;
  // 1. Chunk p of the local statistics to rank p.
  std::vector<std::vector<uint8_t>> parts(n);
  for (int i = 0; i < n; ++i) {
    const int to = (rank + i) % n, from = (rank + n - i) % n;
    if (i == 0) {
      parts[rank] = EncodeStatsBf16(local.subspan(chunk(rank).begin, mine));
      continue;
    }
    const std::vector<uint8_t> out = EncodeStatsBf16(local.subspan(chunk(to).begin, chunk(to).count));
    parts[from].assign(2 * mine, 0);
    DQ_RETURN_IF_ERROR(
        ExchangeHost(backend, mover, to, out, from, absl::MakeSpan(parts[from]), Tag(options.sequence, 0, 1, i)));
  }
  const std::vector<absl::Span<const uint8_t>> contributions(parts.begin(), parts.end());
  DQ_ASSIGN_OR_RETURN(const std::vector<uint8_t> sum, SumStatsBf16(contributions, 2 * mine));
  DQ_RETURN_IF_ERROR(DecodeStatsBf16(sum, reduced.subspan(chunk(rank).begin, mine)));
  // 2. This rank's reduced chunk to every rank; every other chunk from its owner.
  std::vector<uint8_t> in;
  for (int i = 1; i < n; ++i) {
    const int to = (rank + i) % n, from = (rank + n - i) % n;
    in.assign(2 * chunk(from).count, 0);
    DQ_RETURN_IF_ERROR(ExchangeHost(backend, mover, to, sum, from, absl::MakeSpan(in), Tag(options.sequence, 0, 2, i)));
    DQ_RETURN_IF_ERROR(DecodeStatsBf16(in, reduced.subspan(chunk(from).begin, chunk(from).count)));
  }
  return absl::OkStatus();
}

absl::StatusOr<AllReduceResult> Run(const Codec& codec, Transport& transport, const AllReduceOptions& configured,
                                    size_t d, NcclAllReduceBackend& backend) {
  const int n = transport.size();
  const int rank = transport.rank();
  if (!SupportedCodec(codec.id())) return Unsupported(codec);
  // topology=auto, resolved as engine::AllReduce resolves it; the handshake carries the pick.
  AllReduceOptions options = configured;
  options.topology = SelectTopology(configured.topology, d, n, codec, transport.capabilities());
  if (options.bits != 0) {
    return absl::UnimplementedError(
        "a per-collective bit budget (AllReduceOptions::bits) is not supported by the device all-reduce");
  }
  DQ_ASSIGN_OR_RETURN(Schedule schedule, MakeSchedule(options.topology, n));
  DQ_RETURN_IF_ERROR(CheckNcclSchedule(schedule));
  if (options.topology == Topology::kButterfly && !codec.SupportsButterfly()) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", kernels::CodecName(codec.id()), " does not support the butterfly topology"));
  }
  if (d > (size_t{1} << 40)) return absl::InvalidArgumentError(absl::StrCat("bucket of ", d, " elements is too large"));
  AllReduceResult result;
  result.topology = options.topology;
  Mover mover(transport, absl::Now() + options.timeout, result);

  // 0. Every rank must derive the same message sizes.
  DQ_RETURN_IF_ERROR(Handshake(codec, transport, options, d, backend, mover));

  // 1. Statistics and plans: per block, from the block's own reduced statistics, as
  // engine::AllReduce plans them (engine/block_plan.h).
  const size_t stats_len = codec.StatsLength(d);
  BucketPlan plan;
  std::vector<NcclBlock> blocks;
  if (stats_len > 0) {
    if (!PlansPerBlock(codec)) return Unsupported(codec);
    std::vector<float> local_stats(stats_len), reduced_stats(stats_len);
    DQ_RETURN_IF_ERROR(backend.LocalStats(absl::MakeSpan(local_stats)));
    DQ_RETURN_IF_ERROR(ReduceSumStats(transport, options, local_stats, absl::MakeSpan(reduced_stats), backend, mover));
    const size_t block = BlockElements(d, options.block_elements);
    DQ_ASSIGN_OR_RETURN(const size_t num_blocks, NumBlocks(d, options.block_elements));
    std::vector<BucketPlan> plans(num_blocks);
    blocks.resize(num_blocks);
    for (size_t k = 0; k < num_blocks; ++k) {
      const BlockStats range = BlockStatsRange(codec, d, block, k);
      DQ_ASSIGN_OR_RETURN(plans[k],
                          codec.MakePlan(BlockRound(options.sequence, k, rank, n), range.count,
                                         absl::MakeConstSpan(local_stats).subspan(range.offset, range.length),
                                         absl::MakeConstSpan(reduced_stats).subspan(range.offset, range.length)));
      blocks[k].begin = k * block;
      blocks[k].plan = plans[k];
    }
    plan = JoinBlockPlans(plans, options.sequence);
  } else {
    const kernels::RoundInfo round{options.sequence, static_cast<uint32_t>(rank), static_cast<uint32_t>(n)};
    DQ_ASSIGN_OR_RETURN(plan, codec.MakePlan(round, d, {}, {}));
    DQ_ASSIGN_OR_RETURN(blocks, MakeNcclBlocks(plan, options.sequence, options.block_elements));
  }
  DQ_ASSIGN_OR_RETURN(NcclRankProgram program, MakeNcclRankProgram(schedule, rank));
  DQ_ASSIGN_OR_RETURN(auto bytes, NcclChunkBytes(codec, blocks, n));
  DQ_RETURN_IF_ERROR(backend.Setup(plan, blocks, program, bytes));
  const int num_blocks = static_cast<int>(blocks.size());
  result.blocks = num_blocks;

  // 2. Leaves.
  for (int k = 0; k < num_blocks; ++k) {
    for (int c = 0; c < n; ++c) {
      if (program.leaf[c] && c != program.owned_chunk) DQ_RETURN_IF_ERROR(backend.Encode(k, c));
    }
  }

  // 3. Reduce-scatter, 4. the owners' decode, 5. all-gather: one group per step and block.
  auto step = [&](const NcclStep& st, bool all_gather, int s, int k) -> absl::Status {
    DQ_RETURN_IF_ERROR(backend.Ready(k));
    absl::Span<const uint8_t> send;
    absl::Span<uint8_t> recv;
    if (st.send_peer >= 0) send = backend.ChunkBuffer(k, st.send_chunk);
    if (st.recv_peer >= 0) recv = backend.ChunkBuffer(k, st.recv_chunk);
    DQ_RETURN_IF_ERROR(mover.Exchange(st.send_peer, send, st.recv_peer, recv,
                                      Tag(options.sequence, all_gather ? 2 : 1, s, k), /*stats=*/false));
    if (st.recv_peer >= 0) DQ_RETURN_IF_ERROR(backend.OnReceive(k, st, all_gather, s));
    return absl::OkStatus();
  };
  for (size_t s = 0; s < program.reduce_scatter.size(); ++s) {
    for (int k = 0; k < num_blocks; ++k) DQ_RETURN_IF_ERROR(step(program.reduce_scatter[s], false, s, k));
  }
  for (int k = 0; k < num_blocks; ++k) {
    DQ_RETURN_IF_ERROR(backend.Ready(k));
    DQ_RETURN_IF_ERROR(backend.FinishReduceScatter(k));
  }
  for (size_t s = 0; s < program.all_gather.size(); ++s) {
    for (int k = 0; k < num_blocks; ++k) DQ_RETURN_IF_ERROR(step(program.all_gather[s], true, s, k));
  }
  for (int k = 0; k < num_blocks; ++k) DQ_RETURN_IF_ERROR(backend.Ready(k));
  return result;
}

}  // namespace

size_t NcclBlockElements(size_t d, size_t block_elements) { return BlockElements(d, block_elements); }

absl::StatusOr<std::vector<NcclBlock>> MakeNcclBlocks(const BucketPlan& plan, uint64_t sequence,
                                                      size_t block_elements) {
  const size_t d = plan.num_elements;
  const size_t block = BlockElements(d, block_elements);
  DQ_ASSIGN_OR_RETURN(const size_t num_blocks, NumBlocks(d, block_elements));
  std::vector<NcclBlock> blocks(num_blocks);
  for (size_t k = 0; k < num_blocks; ++k) {
    blocks[k].begin = k * block;
    blocks[k].plan = SliceBucketPlan(plan, sequence, k, k * block, std::min(block, d - k * block));
  }
  return blocks;
}

absl::StatusOr<NcclRankProgram> MakeNcclRankProgram(const Schedule& schedule, int rank) {
  const int n = schedule.world_size;
  if (rank < 0 || rank >= n || static_cast<int>(schedule.owner.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of a schedule for ", n, " ranks"));
  }
  DQ_RETURN_IF_ERROR(CheckNcclSchedule(schedule));
  NcclRankProgram p;
  p.rank = rank;
  p.world_size = n;
  p.compress_refs.resize(n);
  for (int c = 0; c < n; ++c) {
    p.compress_refs[c].chunk_id = static_cast<uint32_t>(c);
    if (schedule.owner[c] == rank) p.owned_chunk = c;
  }
  auto bad = [&](const std::string& what) {
    return absl::InternalError(absl::StrCat(TopologyName(schedule.topology), " schedule for ", n, " ranks: ", what));
  };
  auto index = [&](const std::vector<std::vector<Transfer>>& steps, std::vector<NcclStep>& out) -> absl::Status {
    out.assign(steps.size(), NcclStep{});
    for (size_t s = 0; s < steps.size(); ++s) {
      for (const Transfer& t : steps[s]) {
        if (t.from == rank) {
          if (out[s].send_peer >= 0) return bad(absl::StrCat("rank ", rank, " sends twice at step ", s));
          out[s].send_peer = t.to;
          out[s].send_chunk = t.chunk;
        }
        if (t.to == rank) {
          if (out[s].recv_peer >= 0) return bad(absl::StrCat("rank ", rank, " receives twice at step ", s));
          out[s].recv_peer = t.from;
          out[s].recv_chunk = t.chunk;
        }
      }
      if (out[s].send_chunk >= 0 && out[s].send_chunk == out[s].recv_chunk) {
        return bad(absl::StrCat("rank ", rank, " sends and receives chunk ", out[s].send_chunk, " at step ", s));
      }
    }
    return absl::OkStatus();
  };
  DQ_RETURN_IF_ERROR(index(schedule.reduce_scatter, p.reduce_scatter));
  DQ_RETURN_IF_ERROR(index(schedule.all_gather, p.all_gather));

  // Summands as the codecs count them (leaf 1, DAR: the last child's + 1), simulated over all
  // ranks; children still to come per (rank, chunk).
  std::vector<std::vector<uint16_t>> count(n, std::vector<uint16_t>(n, 1));
  std::vector<std::vector<int>> left(n, std::vector<int>(n, 0)), total(n, std::vector<int>(n, 0));
  for (const auto& st : schedule.reduce_scatter) {
    for (const Transfer& t : st) ++total[t.to][t.chunk];
  }
  left = total;
  for (size_t s = 0; s < schedule.reduce_scatter.size(); ++s) {
    const auto& st = schedule.reduce_scatter[s];
    std::vector<uint16_t> sent(st.size());
    for (size_t i = 0; i < st.size(); ++i) {
      const Transfer& t = st[i];
      if (left[t.from][t.chunk] != 0) {
        return bad(absl::StrCat("rank ", t.from, " sends chunk ", t.chunk, " at step ", s, " before its children"));
      }
      if (schedule.owner[t.chunk] == t.from) {
        return bad(absl::StrCat("owner ", t.from, " sends its chunk ", t.chunk, " during the reduce-scatter"));
      }
      sent[i] = count[t.from][t.chunk];
    }
    for (size_t i = 0; i < st.size(); ++i) {
      const Transfer& t = st[i];
      if (t.to == rank) {
        NcclStep& step = p.reduce_scatter[s];
        step.recv_summands = sent[i];
        if (left[t.to][t.chunk] == 1) {
          step.action = NcclReceiveAction::kDar;
          step.from_accumulator = total[t.to][t.chunk] > 1;
        } else {
          step.action = NcclReceiveAction::kAccumulate;
          step.init_accumulator = left[t.to][t.chunk] == total[t.to][t.chunk];
        }
      }
      if (--left[t.to][t.chunk] == 0) count[t.to][t.chunk] = NextSummands(sent[i]);
    }
  }
  p.leaf.assign(n, 0);
  p.accumulator.assign(n, 0);
  p.summands.assign(n, 0);
  for (int c = 0; c < n; ++c) {
    p.accumulator[c] = total[rank][c] > 1;
    if (c == p.owned_chunk) p.summands[c] = count[rank][c];
    if (c == p.owned_chunk && total[rank][c] == 0) p.leaf[c] = 1;
  }
  for (const NcclStep& st : p.reduce_scatter) {
    if (st.send_chunk < 0) continue;
    p.summands[st.send_chunk] = count[rank][st.send_chunk];
    if (total[rank][st.send_chunk] == 0) p.leaf[st.send_chunk] = 1;
  }
  // Correlated-rounding siblings, as RankExecutor.
  for (const NcclStep& st : p.reduce_scatter) {
    if (st.send_chunk < 0) continue;
    p.compress_refs[st.send_chunk] =
        SiblingRef(schedule, p.compress_refs[st.send_chunk], st.send_chunk, rank, st.send_peer);
  }
  // All-gather: every chunk's final bytes carry its owner's summands; a rank forwards only bytes
  // it owns or received at an earlier all-gather step (they stay in the chunk's buffer).
  std::vector<uint8_t> have(n, 0);
  if (p.owned_chunk >= 0) have[p.owned_chunk] = 1;
  for (size_t s = 0; s < p.all_gather.size(); ++s) {
    NcclStep& st = p.all_gather[s];
    if (st.send_chunk >= 0 && !have[st.send_chunk]) {
      return bad(absl::StrCat("rank ", rank, " forwards chunk ", st.send_chunk, " at all-gather step ", s,
                              " before receiving it"));
    }
    if (st.recv_chunk >= 0) {
      const int owner = schedule.owner[st.recv_chunk];
      st.action = NcclReceiveAction::kDecode;
      st.recv_summands = count[owner][st.recv_chunk];
      have[st.recv_chunk] = 1;
    }
  }
  return p;
}

ChunkRef NcclChunkRef(const NcclRankProgram& program, size_t block_count, int chunk) {
  ChunkRef ref = program.compress_refs[chunk];
  if (chunk == program.owned_chunk) ref = ChunkRef{};  // the owner's final compression has no siblings
  const ChunkRef range = ChunkOf(block_count, program.world_size, chunk);
  ref.chunk_id = range.chunk_id;
  ref.begin = range.begin;
  ref.count = range.count;
  return ref;
}

absl::StatusOr<std::vector<std::vector<size_t>>> NcclChunkBytes(const Codec& codec,
                                                                const std::vector<NcclBlock>& blocks, int n) {
  if (!SupportedCodec(codec.id())) return Unsupported(codec);
  std::vector<std::vector<size_t>> bytes(blocks.size(), std::vector<size_t>(n));
  for (size_t k = 0; k < blocks.size(); ++k) {
    const BucketPlan& plan = blocks[k].plan;
    if (codec.id() == CodecId::kDynamiq &&
        plan.widths.size() != (plan.num_elements + kernels::kSuperGroupSize - 1) / kernels::kSuperGroupSize) {
      return absl::InternalError(absl::StrCat("block ", k, " of ", plan.num_elements, " elements has a plan of ",
                                              plan.widths.size(), " super-groups"));
    }
    for (int c = 0; c < n; ++c) {
      const ChunkRef chunk = ChunkOf(plan.num_elements, n, c);
      if (chunk.count > kernels::kMaxChunkElements) {
        return absl::InvalidArgumentError(absl::StrCat("chunk of ", chunk.count, " elements exceeds the limit of ",
                                                       kernels::kMaxChunkElements, "; lower block_elements"));
      }
      bytes[k][c] = codec.MaxEncodedBytes(plan, chunk);
      if (bytes[k][c] - kernels::kChunkHeaderBytes > UINT32_MAX) {  // ChunkHeader::payload_bytes
        return absl::InvalidArgumentError(absl::StrCat("chunk ", c, " of block ", k, " would carry ", bytes[k][c],
                                                       " bytes, more than 4 GiB; use smaller pipelining blocks"));
      }
    }
  }
  return bytes;
}

absl::StatusOr<std::vector<uint8_t>> NcclChunkPrefix(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                                                     uint16_t summands) {
  if (codec.id() == CodecId::kDynamiq) {
    const auto* dynamiq = dynamic_cast<const kernels::DynamiqCodec*>(&codec);
    if (dynamiq == nullptr) return absl::InvalidArgumentError("a dynamiq codec that is not a DynamiqCodec");
    DQ_ASSIGN_OR_RETURN(kernels::DynamiqCudaChunk layout, kernels::PrepareDynamiqCudaChunk(*dynamiq, plan, chunk));
    std::vector<uint8_t> out(kernels::kChunkHeaderBytes + layout.width_map.size());
    DQ_RETURN_IF_ERROR(kernels::WriteDynamiqChunkPrefix(*dynamiq, plan, chunk, layout, summands, absl::MakeSpan(out)));
    return out;
  }
  if (codec.id() != CodecId::kNone && codec.id() != CodecId::kBf16) return Unsupported(codec);
  const uint32_t element_bytes = codec.id() == CodecId::kNone ? 4 : 2;
  kernels::ChunkHeader h;
  h.codec = codec.id();
  h.element_bits = static_cast<uint8_t>(8 * element_bytes);
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = summands;
  h.payload_bytes = static_cast<uint32_t>(element_bytes * chunk.count);
  std::vector<uint8_t> out(kernels::kChunkHeaderBytes);
  kernels::WriteChunkHeader(h, absl::MakeSpan(out));
  return out;
}

absl::Status NcclCheckChunkPrefix(absl::Span<const uint8_t> received, absl::Span<const uint8_t> expected) {
  if (received.size() == expected.size() && std::equal(received.begin(), received.end(), expected.begin())) {
    return absl::OkStatus();
  }
  if (received.size() != expected.size() || received.size() < kernels::kChunkHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk prefix of ", received.size(), " bytes, expected ", expected.size()));
  }
  struct Field {
    const char* name;
    size_t offset, size;
  };
  static constexpr Field kFields[] = {{"magic", 0, 4},        {"version", 4, 1},        {"codec", 5, 1},
                                      {"element bits", 6, 1}, {"flags", 7, 1},          {"elements", 8, 4},
                                      {"chunk id", 12, 4},    {"round", 16, 4},         {"summands", 20, 2},
                                      {"reserved", 22, 2},    {"payload bytes", 24, 4}, {"param", 28, 4}};
  auto read = [](absl::Span<const uint8_t> b, const Field& f) {
    uint64_t v = 0;
    for (size_t i = 0; i < f.size; ++i) v |= static_cast<uint64_t>(b[f.offset + i]) << (8 * i);
    return v;
  };
  std::vector<std::string> diffs;
  for (const Field& f : kFields) {
    const uint64_t got = read(received, f), want = read(expected, f);
    if (got != want) diffs.push_back(absl::StrCat(f.name, " ", got, " (expected ", want, ")"));
  }
  if (!diffs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("chunk header differs: ", absl::StrJoin(diffs, ", ")));
  }
  for (size_t i = kernels::kChunkHeaderBytes; i < received.size(); ++i) {
    if (received[i] == expected[i]) continue;
    const size_t j = 2 * (i - kernels::kChunkHeaderBytes) + ((received[i] & 15) == (expected[i] & 15) ? 1 : 0);
    const int shift = j % 2 == 0 ? 0 : 4;
    return absl::InvalidArgumentError(absl::StrCat(
        "super-group ", j, " of the chunk arrived with ", (received[i] >> shift) & 15, "-bit codes, the plan says ",
        (expected[i] >> shift) & 15, " (ranks disagree on the bit allocation)"));
  }
  return absl::InternalError("chunk prefixes differ");  // unreachable
}

std::vector<NcclWireOp> NcclWireOps(const NcclRankProgram& program, const std::vector<std::vector<size_t>>& bytes) {
  std::vector<NcclWireOp> ops;
  int group = 0;
  for (const auto* steps : {&program.reduce_scatter, &program.all_gather}) {
    for (const NcclStep& st : *steps) {
      for (size_t k = 0; k < bytes.size(); ++k, ++group) {
        if (st.send_peer >= 0) {
          ops.push_back(
              NcclWireOp{group, true, st.send_peer, static_cast<int>(k), st.send_chunk, bytes[k][st.send_chunk]});
        }
        if (st.recv_peer >= 0) {
          ops.push_back(
              NcclWireOp{group, false, st.recv_peer, static_cast<int>(k), st.recv_chunk, bytes[k][st.recv_chunk]});
        }
      }
    }
  }
  return ops;
}

StepHeader NcclHandshakeHeader(const Codec& codec, const AllReduceOptions& options, size_t d, int sender) {
  const kernels::CodecConfig& config = codec.config();
  const size_t block = NcclBlockElements(d, options.block_elements);
  // Everything that decides a message size or the bytes' meaning, beyond MatchStepHeader's fields.
  std::vector<uint8_t> digest;
  Append<uint64_t>(digest, d);
  Append<uint8_t>(digest, static_cast<uint8_t>(options.topology));
  Append<uint64_t>(digest, block);
  Append<uint8_t>(digest, static_cast<uint8_t>(config.id));
  Append<double>(digest, config.bits);
  Append<uint8_t>(digest, static_cast<uint8_t>(config.allocator));
  Append<uint8_t>(digest, static_cast<uint8_t>(config.levels));
  Append<uint8_t>(digest, config.correlated_rounding ? 1 : 0);
  Append<uint64_t>(digest, config.seed);
  StepHeader h;
  h.phase = Phase::kStats;
  h.codec = static_cast<uint8_t>(codec.id());
  h.schedule = ScheduleId(options.topology);
  h.bits_x1000 = static_cast<uint32_t>(std::lround(config.bits * 1000));
  h.sender = static_cast<uint32_t>(sender);
  h.job_id = options.job_id;
  h.config_epoch = options.config_epoch;
  h.sequence = options.sequence;
  h.step = 0;
  h.block = static_cast<uint32_t>(d == 0 ? 1 : (d + block - 1) / block);
  h.payload_bytes = static_cast<uint32_t>(d);
  h.checksum = PayloadChecksum(digest);
  return h;
}

absl::StatusOr<AllReduceResult> RunNcclAllReduce(const Codec& codec, Transport& transport,
                                                 const AllReduceOptions& options, size_t num_elements,
                                                 NcclAllReduceBackend& backend) {
  absl::StatusOr<AllReduceResult> result = Run(codec, transport, options, num_elements, backend);
  if (result.ok()) return result;
  // As engine::AllReduce: the group is broken for this collective; nothing may stay posted into
  // buffers the backend is about to free.
  transport.Abort();
  return Annotate(result.status(), transport.rank());
}

}  // namespace dynamiq::engine
