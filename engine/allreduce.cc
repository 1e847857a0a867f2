#include "engine/allreduce.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/rank_executor.h"
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
enum Part { kHeader = 0, kPayload = 1, kClearToSend = 2 };
uint64_t Tag(uint64_t sequence, Phase phase, uint32_t step, uint32_t block, Part part) {
  return ((sequence & 0xffffff) << 40) | (static_cast<uint64_t>(phase) << 38) |
         (static_cast<uint64_t>(step & 0xffff) << 22) | (static_cast<uint64_t>(block & 0xfffff) << 2) |
         static_cast<uint64_t>(part);
}

uint32_t BitsX1000(const Codec& codec) { return static_cast<uint32_t>(std::lround(codec.config().bits * 1000)); }

// Moves the messages of collectives over one transport, with validated step headers.
class Runner {
 public:
  Runner(Transport& transport, const AllReduceOptions& options, absl::Time deadline, AllReduceResult& result)
      : t_(transport), o_(options), deadline_(deadline), result_(result) {}
  // Receives still posted into our buffers mean the collective failed: abort the transport before
  // the buffers are freed, so nothing can write into them afterwards.
  ~Runner() {
    if (!preposted_.empty()) t_.Abort();
  }

  // What one block sends and expects at one step.
  struct Transfer {
    int send_peer = -1;
    absl::Span<const uint8_t> send;
    int recv_peer = -1;
    size_t recv_max = 0;  // bytes the plan allows for the incoming message
  };

  // Exchanges one step for all blocks. Per transfer: the sender posts its header; the receiver
  // validates it, posts a receive of exactly the announced payload and answers with a one-byte
  // clear-to-send; only then is the payload sent. Payloads therefore always land in a receive of
  // the right size that is already posted (Gloo handles unexpected sends slowly and would abort on
  // an oversized one), at the cost of one round trip per step shared by all blocks. Each block is
  // handed to `deliver(block, bytes)` as soon as it arrives while later blocks are in flight.
  // Posts the small receives of a future step (its header, and the clear-to-send for what this
  // rank will send) ahead of time, so that no header or clear-to-send ever arrives before its
  // receive is posted (Gloo takes milliseconds on that path).
  absl::Status Prepost(Phase phase, uint32_t step, size_t block, int recv_peer, int send_peer) {
    auto [it, fresh] = preposted_.try_emplace(Key(phase, step, block));
    if (!fresh) return absl::OkStatus();
    Preposted& p = it->second;
    if (recv_peer >= 0) {
      DQ_ASSIGN_OR_RETURN(p.header, t_.PostRecv(recv_peer, Tag(o_.sequence, phase, step, block, kHeader),
                                                absl::MakeSpan(p.header_bytes)));
    }
    if (send_peer >= 0) {
      DQ_ASSIGN_OR_RETURN(p.cts, t_.PostRecv(send_peer, Tag(o_.sequence, phase, step, block, kClearToSend),
                                             absl::MakeSpan(&p.cts_byte, 1)));
    }
    return absl::OkStatus();
  }

  template <typename Deliver>
  absl::Status Step(Phase phase, uint32_t step, const Codec& codec, std::vector<Transfer>& transfers,
                    Deliver&& deliver) {
    StepBuffers buffers;
    absl::Status status = StepImpl(phase, step, codec, transfers, deliver, buffers);
    // A failed step may leave sends/receives posted on `buffers`: abort before they are freed.
    if (!status.ok()) t_.Abort();
    return status;
  }

 private:
  // Memory the transport may touch while a step's operations are posted.
  struct StepBuffers {
    std::vector<std::array<uint8_t, kStepHeaderBytes>> send_headers;
    std::vector<uint8_t> cts_out;
    std::vector<std::vector<uint8_t>> payloads;
  };

  template <typename Deliver>
  absl::Status StepImpl(Phase phase, uint32_t step, const Codec& codec, std::vector<Transfer>& transfers,
                        Deliver& deliver, StepBuffers& buffers) {
    const size_t blocks = transfers.size();
    for (size_t k = 0; k < blocks; ++k) {
      DQ_RETURN_IF_ERROR(Prepost(phase, step, k, transfers[k].recv_peer, transfers[k].send_peer));
    }
    auto& send_headers = buffers.send_headers;
    send_headers.resize(blocks);
    auto& cts_out = buffers.cts_out;
    cts_out.assign(blocks, 1);
    std::vector<Transport::Handle> sends, payload_recvs(blocks, 0);
    std::vector<Preposted*> pre(blocks);
    for (size_t k = 0; k < blocks; ++k) {
      pre[k] = &preposted_.at(Key(phase, step, k));
      Transfer& x = transfers[k];
      if (x.send_peer >= 0) {
        if (x.send.size() > UINT32_MAX) {
          return absl::InvalidArgumentError(
              absl::StrCat("message of ", x.send.size(), " bytes exceeds 4 GiB; use smaller pipelining blocks"));
        }
        StepHeader h = Expected(phase, step, k, codec, t_.rank());
        h.payload_bytes = static_cast<uint32_t>(x.send.size());
        if (o_.authenticator != nullptr) {
          send_headers[k] = o_.authenticator->Seal(h, static_cast<uint32_t>(x.send_peer), x.send);
        } else {
          h.checksum = PayloadChecksum(x.send);
          send_headers[k] = EncodeStepHeader(h);
        }
        DQ_ASSIGN_OR_RETURN(auto a,
                            t_.PostSend(x.send_peer, Tag(o_.sequence, phase, step, k, kHeader), send_headers[k]));
        sends.push_back(a);
        result_.bytes_sent += kStepHeaderBytes + x.send.size();
        if (phase == Phase::kStats) result_.stats_bytes_sent += kStepHeaderBytes + x.send.size();
      }
    }
    auto& payloads = buffers.payloads;
    payloads.resize(blocks);
    std::vector<StepHeader> headers(blocks);
    for (size_t k = 0; k < blocks; ++k) {
      Transfer& x = transfers[k];
      if (x.recv_peer < 0) continue;
      DQ_RETURN_IF_ERROR(Peer(t_.Wait(pre[k]->header, deadline_), x.recv_peer));
      DQ_ASSIGN_OR_RETURN(headers[k], Peer(DecodeStepHeader(pre[k]->header_bytes), x.recv_peer));
      DQ_RETURN_IF_ERROR(MatchStepHeader(headers[k], Expected(phase, step, k, codec, x.recv_peer)));
      DQ_RETURN_IF_ERROR(CheckAuthenticationMode(headers[k], x.recv_peer));
      if (headers[k].payload_bytes > x.recv_max) {
        return absl::InvalidArgumentError(absl::StrCat("rank ", x.recv_peer, " announced ", headers[k].payload_bytes,
                                                       " payload bytes at step ", step, ", at most ", x.recv_max,
                                                       " are possible"));
      }
      payloads[k].resize(headers[k].payload_bytes);
      DQ_ASSIGN_OR_RETURN(payload_recvs[k], t_.PostRecv(x.recv_peer, Tag(o_.sequence, phase, step, k, kPayload),
                                                        absl::MakeSpan(payloads[k])));
      DQ_ASSIGN_OR_RETURN(auto c, t_.PostSend(x.recv_peer, Tag(o_.sequence, phase, step, k, kClearToSend),
                                              absl::MakeConstSpan(&cts_out[k], 1)));
      sends.push_back(c);
    }
    for (size_t k = 0; k < blocks; ++k) {
      Transfer& x = transfers[k];
      if (x.send_peer < 0) continue;
      DQ_RETURN_IF_ERROR(Peer(t_.Wait(pre[k]->cts, deadline_), x.send_peer));
      DQ_ASSIGN_OR_RETURN(auto b, t_.PostSend(x.send_peer, Tag(o_.sequence, phase, step, k, kPayload), x.send));
      sends.push_back(b);
    }
    for (size_t k = 0; k < blocks; ++k) {
      Transfer& x = transfers[k];
      if (x.recv_peer < 0) continue;
      DQ_RETURN_IF_ERROR(Peer(t_.Wait(payload_recvs[k], deadline_), x.recv_peer));
      result_.bytes_received += kStepHeaderBytes + payloads[k].size();
      // Verified before `deliver` decodes anything.
      if (o_.authenticator != nullptr) {
        if (!o_.authenticator->Verify(pre[k]->header_bytes, static_cast<uint32_t>(t_.rank()), payloads[k])) {
          return absl::UnauthenticatedError(absl::StrCat(
              "authentication failed: the message from rank ", x.recv_peer, " at step ", step, " block ", k,
              " has a bad MAC (a different cluster secret, or altered in transit); its payload was not decoded"));
        }
      } else if (PayloadChecksum(payloads[k]) != headers[k].checksum) {
        return absl::DataLossError(absl::StrCat("payload from rank ", x.recv_peer, " at step ", step, " block ", k,
                                                " failed its checksum (corrupted in transit)"));
      }
      DQ_RETURN_IF_ERROR(deliver(k, absl::Span<const uint8_t>(payloads[k])));
    }
    for (Transport::Handle h : sends) DQ_RETURN_IF_ERROR(t_.Wait(h, deadline_));
    for (size_t k = 0; k < blocks; ++k) preposted_.erase(Key(phase, step, k));
    return absl::OkStatus();
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

  struct Preposted {
    std::array<uint8_t, kStepHeaderBytes> header_bytes{};
    uint8_t cts_byte = 0;
    Transport::Handle header = 0, cts = 0;
  };
  static uint64_t Key(Phase phase, uint32_t step, size_t block) {
    return (static_cast<uint64_t>(phase) << 60) | (static_cast<uint64_t>(step) << 32) | block;
  }

  Transport& t_;
  const AllReduceOptions& o_;
  std::map<uint64_t, Preposted> preposted_;  // node-based: receive buffers never move
  absl::Time deadline_;
  AllReduceResult& result_;
};

// Runs reduce-scatter and all-gather for every block's executor.
absl::Status RunExecutors(Runner& runner, const Codec& codec, const Schedule& schedule, Phase rs_phase, Phase ag_phase,
                          uint32_t step_offset, std::vector<std::unique_ptr<RankExecutor>>& blocks) {
  const int n = schedule.world_size;
  const uint32_t ag_offset = step_offset + static_cast<uint32_t>(n);
  for (size_t k = 0; k < blocks.size(); ++k) {
    RankExecutor& x = *blocks[k];
    for (size_t s = 0; s < schedule.reduce_scatter.size(); ++s) {
      DQ_RETURN_IF_ERROR(
          runner.Prepost(rs_phase, step_offset + s, k, x.ReduceScatterRecvPeer(s), x.ReduceScatterSendPeer(s)));
    }
    for (size_t s = 0; s < schedule.all_gather.size(); ++s) {
      DQ_RETURN_IF_ERROR(runner.Prepost(ag_phase, ag_offset + s, k, x.AllGatherRecvPeer(s), x.AllGatherSendPeer(s)));
    }
  }
  std::vector<Runner::Transfer> transfers(blocks.size());
  for (size_t s = 0; s < schedule.reduce_scatter.size(); ++s) {
    for (size_t k = 0; k < blocks.size(); ++k) {
      RankExecutor& x = *blocks[k];
      transfers[k] = Runner::Transfer{};
      transfers[k].send_peer = x.ReduceScatterSendPeer(s);
      if (transfers[k].send_peer >= 0) {
        DQ_ASSIGN_OR_RETURN(transfers[k].send, x.ReduceScatterSend(s));
      }
      transfers[k].recv_peer = x.ReduceScatterRecvPeer(s);
      if (transfers[k].recv_peer >= 0) transfers[k].recv_max = x.MaxMessageBytes(x.ReduceScatterRecvChunk(s));
    }
    DQ_RETURN_IF_ERROR(runner.Step(rs_phase, step_offset + s, codec, transfers,
                                   [&](size_t k, auto bytes) { return blocks[k]->ReduceScatterReceive(s, bytes); }));
  }
  for (auto& x : blocks) DQ_RETURN_IF_ERROR(x->FinishReduceScatter());
  for (size_t s = 0; s < schedule.all_gather.size(); ++s) {
    for (size_t k = 0; k < blocks.size(); ++k) {
      RankExecutor& x = *blocks[k];
      transfers[k] = Runner::Transfer{};
      transfers[k].send_peer = x.AllGatherSendPeer(s);
      if (transfers[k].send_peer >= 0) {
        DQ_ASSIGN_OR_RETURN(transfers[k].send, x.AllGatherSend(s));
      }
      transfers[k].recv_peer = x.AllGatherRecvPeer(s);
      if (transfers[k].recv_peer >= 0) transfers[k].recv_max = x.MaxMessageBytes(x.AllGatherRecvChunk(s));
    }
    DQ_RETURN_IF_ERROR(runner.Step(ag_phase, ag_offset + s, codec, transfers,
                                   [&](size_t k, auto bytes) { return blocks[k]->AllGatherReceive(s, bytes); }));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

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
  AllReduceResult result;
  const absl::Time deadline = absl::Now() + options.timeout;
  Runner runner(transport, options, deadline, result);

  // 1. Statistics and plan.
  const size_t stats_len = codec.StatsLength(d);
  std::vector<float> local_stats(stats_len), reduced_stats(stats_len);
  if (stats_len > 0) {
    kernels::Source raw = local;
    raw.subtract_per_group = nullptr;
    codec.ComputeStats(raw, d, local_stats.data());
    if (codec.stats_reduction() == kernels::StatsReduction::kSum) {
      kernels::CodecConfig bf16_config;
      bf16_config.id = kernels::CodecId::kBf16;
      DQ_ASSIGN_OR_RETURN(auto bf16, kernels::CreateCodec(bf16_config));
      BucketPlan stats_plan;
      stats_plan.round = kernels::RoundInfo{options.sequence, static_cast<uint32_t>(rank), static_cast<uint32_t>(n)};
      stats_plan.num_elements = stats_len;
      std::vector<std::unique_ptr<RankExecutor>> stats_exec;
      stats_exec.push_back(std::make_unique<RankExecutor>(
          *bf16, schedule, stats_plan, kernels::Source{local_stats.data(), kernels::DType::kFloat32, 0, nullptr},
          kernels::Dest{reduced_stats.data(), kernels::DType::kFloat32, 0, nullptr}));
      DQ_RETURN_IF_ERROR(
          Annotate(RunExecutors(runner, *bf16, schedule, Phase::kStats, Phase::kStats, 0, stats_exec), rank));
    } else {
      // Maxima: a ring all-gather of every rank's raw statistics.
      reduced_stats = local_stats;
      std::vector<uint8_t> forward(stats_len * sizeof(float));
      std::memcpy(forward.data(), local_stats.data(), forward.size());
      for (int s = 0; s + 1 < n; ++s) {
        DQ_RETURN_IF_ERROR(
            runner.Prepost(Phase::kStats, static_cast<uint32_t>(s), 0, (rank + n - 1) % n, (rank + 1) % n));
      }
      for (int s = 0; s + 1 < n; ++s) {
        std::vector<Runner::Transfer> transfers(1);
        transfers[0].send_peer = (rank + 1) % n;
        transfers[0].send = forward;
        transfers[0].recv_peer = (rank + n - 1) % n;
        transfers[0].recv_max = forward.size();
        std::vector<uint8_t> next;
        DQ_RETURN_IF_ERROR(Annotate(runner.Step(Phase::kStats, static_cast<uint32_t>(s), codec, transfers,
                                                [&](size_t, absl::Span<const uint8_t> bytes) -> absl::Status {
                                                  if (bytes.size() != stats_len * sizeof(float)) {
                                                    return absl::InvalidArgumentError("statistics size mismatch");
                                                  }
                                                  next.assign(bytes.begin(), bytes.end());
                                                  return absl::OkStatus();
                                                }),
                                    rank));
        std::vector<float> values(stats_len);
        std::memcpy(values.data(), next.data(), next.size());
        for (size_t i = 0; i < stats_len; ++i) {
          reduced_stats[i] = std::max(reduced_stats[i], values[i]);
          if (std::isnan(values[i])) reduced_stats[i] = values[i];
        }
        forward = std::move(next);
      }
    }
  }
  const kernels::RoundInfo round{options.sequence, static_cast<uint32_t>(rank), static_cast<uint32_t>(n)};
  DQ_ASSIGN_OR_RETURN(BucketPlan plan, codec.MakePlan(round, d, local_stats, reduced_stats));

  // 2. Blocks: sub-buckets with their slice of the plan.
  size_t block = options.block_elements == 0 ? d : options.block_elements;
  block = std::max<size_t>(kernels::kSuperGroupSize, (block + kernels::kSuperGroupSize - 1) / kernels::kSuperGroupSize *
                                                         kernels::kSuperGroupSize);
  const size_t num_blocks = d == 0 ? 1 : (d + block - 1) / block;
  if (num_blocks > (1u << 20)) return absl::InvalidArgumentError("too many pipelining blocks; raise block_elements");
  result.blocks = static_cast<int>(num_blocks);
  std::vector<BucketPlan> plans(num_blocks);
  std::vector<std::unique_ptr<RankExecutor>> executors;
  const size_t elem = kernels::DTypeSize(local.dtype), out_elem = kernels::DTypeSize(out.dtype);
  for (size_t k = 0; k < num_blocks; ++k) {
    const size_t begin = k * block, count = std::min(block, d - begin);
    const size_t sg0 = begin / kernels::kSuperGroupSize,
                 sgs = (count + kernels::kSuperGroupSize - 1) / kernels::kSuperGroupSize;
    BucketPlan& p = plans[k];
    p.round = kernels::RoundInfo{options.sequence * 1048576 + k, static_cast<uint32_t>(rank), static_cast<uint32_t>(n)};
    p.num_elements = count;
    p.global_scale = plan.global_scale;
    if (!plan.widths.empty()) p.widths.assign(plan.widths.begin() + sg0, plan.widths.begin() + sg0 + sgs);
    if (!plan.local_means.empty()) {
      p.local_means.assign(plan.local_means.begin() + sg0, plan.local_means.begin() + sg0 + sgs);
      p.mean_sums.assign(plan.mean_sums.begin() + sg0, plan.mean_sums.begin() + sg0 + sgs);
    }
    kernels::Source src{static_cast<const uint8_t*>(local.data) + (begin - local.first) * elem, local.dtype, 0,
                        p.local_means.empty() ? nullptr : p.local_means.data()};
    kernels::Dest dst{static_cast<uint8_t*>(out.data) + (begin - out.first) * out_elem, out.dtype, 0,
                      p.mean_sums.empty() ? nullptr : p.mean_sums.data()};
    executors.push_back(std::make_unique<RankExecutor>(codec, schedule, p, src, dst));
  }

  // 3. Reduce-scatter and all-gather, all blocks per step.
  DQ_RETURN_IF_ERROR(
      Annotate(RunExecutors(runner, codec, schedule, Phase::kReduceScatter, Phase::kAllGather, 0, executors), rank));
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
