#include "engine/simulator.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/rank_executor.h"
#include "engine/stats_exchange.h"

namespace dynamiq::engine {
namespace {

using kernels::BucketPlan;
using kernels::Codec;
using kernels::Dest;
using kernels::Source;

// Runs the reduce-scatter and all-gather of one bucket for all ranks, given their plans.
// With one rank nothing travels; count the one compressed chunk as its "message".
absl::Status RunSchedule(const Codec& codec, const Schedule& schedule, absl::Span<const BucketPlan> plans,
                         absl::Span<const Source> inputs, absl::Span<const Dest> outputs, SimulationResult& result) {
  const int n = schedule.world_size;
  std::vector<std::unique_ptr<RankExecutor>> ranks;
  for (int r = 0; r < n; ++r)
    ranks.push_back(std::make_unique<RankExecutor>(codec, schedule, plans[r], inputs[r], outputs[r]));
  std::vector<std::vector<uint8_t>> inbox(n);
  auto exchange = [&](bool reduce_scatter, int step) -> absl::Status {
    // Sends first, as on a network: a rank's outgoing bytes never depend on what arrives this step.
    for (int r = 0; r < n; ++r) {
      RankExecutor& x = *ranks[r];
      const int to = reduce_scatter ? x.ReduceScatterSendPeer(step) : x.AllGatherSendPeer(step);
      if (to < 0) continue;
      DQ_ASSIGN_OR_RETURN(auto bytes, reduce_scatter ? x.ReduceScatterSend(step) : x.AllGatherSend(step));
      inbox[to].assign(bytes.begin(), bytes.end());
      result.bytes_sent[r] += bytes.size();
    }
    for (int r = 0; r < n; ++r) {
      RankExecutor& x = *ranks[r];
      const int from = reduce_scatter ? x.ReduceScatterRecvPeer(step) : x.AllGatherRecvPeer(step);
      if (from < 0) continue;
      absl::Status s = reduce_scatter ? x.ReduceScatterReceive(step, inbox[r]) : x.AllGatherReceive(step, inbox[r]);
      if (!s.ok()) return common::Annotate(s, absl::StrCat("rank ", r));
    }
    return absl::OkStatus();
  };
  for (size_t s = 0; s < schedule.reduce_scatter.size(); ++s) DQ_RETURN_IF_ERROR(exchange(true, s));
  for (int r = 0; r < n; ++r) DQ_RETURN_IF_ERROR(ranks[r]->FinishReduceScatter());
  if (n == 1) result.bytes_sent[0] += ranks[0]->owned_bytes();
  for (size_t s = 0; s < schedule.all_gather.size(); ++s) DQ_RETURN_IF_ERROR(exchange(false, s));
  return absl::OkStatus();
}

// Reduces every rank's statistics the way the network engines do: sums through the bf16 direct
// exchange, maxima through an all-gather of fp32 values.
absl::StatusOr<std::vector<std::vector<float>>> ReduceStats(const Codec& codec, const Schedule& schedule,
                                                            const std::vector<std::vector<float>>& local,
                                                            SimulationResult& result) {
  const int n = schedule.world_size;
  const size_t len = local[0].size();
  std::vector<std::vector<float>> reduced(n, std::vector<float>(len));
  if (codec.stats_reduction() == kernels::StatsReduction::kMax) {
    for (int r = 0; r < n; ++r) {
      for (int q = 0; q < n; ++q) {
        for (size_t i = 0; i < len; ++i) reduced[r][i] = q == 0 ? local[q][i] : std::max(reduced[r][i], local[q][i]);
      }
      result.bytes_sent[r] += (n - 1) * len * sizeof(float);
      result.stats_bytes_sent += (n - 1) * len * sizeof(float);
    }
    return reduced;
  }
  // Sums: the engines' direct exchange (engine/stats_exchange.h). Rank p owns chunk p: it gets the
  // chunk from every other rank and sends the bf16 sum back to each.
  for (int p = 0; p < n; ++p) {
    const kernels::ChunkRef c = ChunkOf(len, n, p);
    std::vector<std::vector<uint8_t>> parts(n);
    std::vector<absl::Span<const uint8_t>> contributions(n);
    for (int q = 0; q < n; ++q) {
      parts[q] = EncodeStatsBf16(absl::MakeConstSpan(local[q]).subspan(c.begin, c.count));
      contributions[q] = parts[q];
    }
    DQ_ASSIGN_OR_RETURN(const std::vector<uint8_t> sum, SumStatsBf16(contributions, 2 * c.count));
    for (int r = 0; r < n; ++r) {
      DQ_RETURN_IF_ERROR(DecodeStatsBf16(sum, absl::MakeSpan(reduced[r]).subspan(c.begin, c.count)));
      if (r == p) continue;
      // Rank r's chunk p to p, and p's sum back to r.
      result.bytes_sent[r] += sum.size();
      result.bytes_sent[p] += sum.size();
      result.stats_bytes_sent += 2 * sum.size();
    }
  }
  return reduced;
}

}  // namespace

absl::StatusOr<SimulationResult> SimulateAllReduce(const Codec& codec, const Schedule& schedule, size_t d,
                                                   uint64_t round, absl::Span<const Source> inputs,
                                                   absl::Span<const Dest> outputs) {
  const int n = schedule.world_size;
  if (static_cast<int>(inputs.size()) != n || static_cast<int>(outputs.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("need ", n, " inputs and outputs, got ", inputs.size(), " and ", outputs.size()));
  }
  if (schedule.topology == Topology::kButterfly && !codec.SupportsButterfly()) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", kernels::CodecName(codec.id()), " does not support the butterfly topology"));
  }
  SimulationResult result;
  result.bytes_sent.assign(n, 0);
  const size_t stats_len = codec.StatsLength(d);
  std::vector<std::vector<float>> local(n, std::vector<float>(stats_len));
  std::vector<std::vector<float>> reduced(n);
  if (stats_len > 0) {
    for (int r = 0; r < n; ++r) codec.ComputeStats(inputs[r], d, local[r].data());
    DQ_ASSIGN_OR_RETURN(reduced, ReduceStats(codec, schedule, local, result));
  }
  std::vector<BucketPlan> plans;
  for (int r = 0; r < n; ++r) {
    const kernels::RoundInfo info{round, static_cast<uint32_t>(r), static_cast<uint32_t>(n)};
    DQ_ASSIGN_OR_RETURN(BucketPlan plan, codec.MakePlan(info, d, local[r], reduced[r]));
    plans.push_back(std::move(plan));
  }
  std::vector<Source> in(inputs.begin(), inputs.end());
  std::vector<Dest> out(outputs.begin(), outputs.end());
  for (int r = 0; r < n; ++r) {
    if (!plans[r].local_means.empty()) in[r].subtract_per_group = plans[r].local_means.data();
    if (!plans[r].mean_sums.empty()) out[r].add_per_group = plans[r].mean_sums.data();
  }
  if (!plans.empty()) result.widths = plans[0].widths;
  DQ_RETURN_IF_ERROR(RunSchedule(codec, schedule, plans, in, out, result));
  for (uint64_t b : result.bytes_sent) result.total_bytes_sent += b;
  return result;
}

double WireBitsPerCoord(const SimulationResult& result, size_t d, int n) {
  if (d == 0) return 0;
  const double messages_per_coord = n > 1 ? 2.0 * (n - 1) : 1.0;
  return 8.0 * static_cast<double>(result.total_bytes_sent) / (static_cast<double>(d) * messages_per_coord);
}

}  // namespace dynamiq::engine
