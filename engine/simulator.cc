#include "engine/simulator.h"

#include <algorithm>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/rank_executor.h"
#include "engine/stats_exchange.h"
#include "kernels/cpu/bucket_transform.h"
#include "kernels/cpu/buffer_io.h"

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
  // (from, to): a step's message on that link (one at most); the buffers are reused step after step.
  std::map<std::pair<int, int>, std::vector<uint8_t>> inbox;
  auto exchange = [&](bool reduce_scatter, int step) -> absl::Status {
    // Sends first, as on a network: a rank's outgoing bytes never depend on what arrives this step.
    for (int r = 0; r < n; ++r) {
      RankExecutor& x = *ranks[r];
      const std::vector<Transfer>& sends = reduce_scatter ? x.ReduceScatterSends(step) : x.AllGatherSends(step);
      for (size_t i = 0; i < sends.size(); ++i) {
        const int j = static_cast<int>(i);
        DQ_ASSIGN_OR_RETURN(auto bytes, reduce_scatter ? x.ReduceScatterSend(step, j) : x.AllGatherSend(step, j));
        inbox[{r, sends[i].to}].assign(bytes.begin(), bytes.end());
        result.bytes_sent[r] += bytes.size();
        if (reduce_scatter) {
          x.ReduceScatterSent(step, j);
        } else {
          x.AllGatherSent(step, j);
        }
      }
    }
    // Then every rank's receives, in the schedule's order.
    for (int r = 0; r < n; ++r) {
      RankExecutor& x = *ranks[r];
      const std::vector<Transfer>& receives =
          reduce_scatter ? x.ReduceScatterReceives(step) : x.AllGatherReceives(step);
      for (size_t i = 0; i < receives.size(); ++i) {
        const int j = static_cast<int>(i);
        const std::vector<uint8_t>& message = inbox[{receives[i].from, r}];
        absl::Status s =
            reduce_scatter ? x.ReduceScatterReceive(step, j, message) : x.AllGatherReceive(step, j, message);
        if (!s.ok()) return common::Annotate(s, absl::StrCat("rank ", r));
      }
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

absl::Status CheckArguments(const Codec& codec, const Schedule& schedule, absl::Span<const Source> inputs,
                            absl::Span<const Dest> outputs) {
  const int n = schedule.world_size;
  if (static_cast<int>(inputs.size()) != n || static_cast<int>(outputs.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("need ", n, " inputs and outputs, got ", inputs.size(), " and ", outputs.size()));
  }
  // Butterfly and two-shot chunks have several children, summed in an fp32 accumulator.
  if (schedule.topology != Topology::kRing && !codec.SupportsButterfly()) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", kernels::CodecName(codec.id()), " does not support the ",
                                                   TopologyName(schedule.topology), " topology"));
  }
  return absl::OkStatus();
}

struct Statistics {
  std::vector<std::vector<float>> local, reduced;  // per rank
};

// Every rank's statistics and their reduction (counted in `result`), as the engines exchange them.
absl::StatusOr<Statistics> ExchangeStats(const Codec& codec, const Schedule& schedule, size_t d,
                                         absl::Span<const Source> inputs, SimulationResult& result) {
  const int n = schedule.world_size;
  const size_t stats_len = codec.StatsLength(d);
  Statistics s;
  s.local.assign(n, std::vector<float>(stats_len));
  s.reduced.resize(n);
  if (stats_len > 0) {
    for (int r = 0; r < n; ++r) codec.ComputeStats(inputs[r], d, s.local[r].data());
    DQ_ASSIGN_OR_RETURN(s.reduced, ReduceStats(codec, schedule, s.local, result));
  }
  return s;
}

// Every rank's plan at `bits` (0: the codec's own).
absl::StatusOr<std::vector<BucketPlan>> MakePlans(const Codec& codec, const Statistics& stats, size_t d, uint64_t round,
                                                  double bits) {
  const int n = static_cast<int>(stats.local.size());
  std::vector<BucketPlan> plans;
  for (int r = 0; r < n; ++r) {
    const kernels::RoundInfo info{round, static_cast<uint32_t>(r), static_cast<uint32_t>(n), bits};
    DQ_ASSIGN_OR_RETURN(BucketPlan plan, codec.MakePlan(info, d, stats.local[r], stats.reduced[r]));
    plans.push_back(std::move(plan));
  }
  return plans;
}

// The plan's centring on the rank's input and output.
void Centre(const BucketPlan& plan, Source& in, Dest& out) {
  if (!plan.local_means.empty()) in.subtract_per_group = plan.local_means.data();
  if (!plan.mean_sums.empty()) out.add_per_group = plan.mean_sums.data();
}

// Codecs with a whole-bucket transform (THC's rotation): every rank's bucket is transformed, `run`
// simulates the all-reduce of the transformed buckets in place, and each rank's sum is transformed
// back into its output, as the engines do (kernels/cpu/bucket_transform.h).
template <typename Run>
absl::StatusOr<SimulationResult> WithBucketTransform(const Codec& codec, size_t d, uint64_t round,
                                                     absl::Span<const Source> inputs, absl::Span<const Dest> outputs,
                                                     Run run) {
  if (!codec.NeedsBucketTransform()) return run(d, inputs, outputs);
  if (inputs.size() != outputs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("need as many inputs as outputs, got ", inputs.size(), " and ", outputs.size()));
  }
  const uint32_t n = static_cast<uint32_t>(inputs.size());
  std::vector<kernels::BucketTransform> buckets;
  std::vector<Source> in;
  std::vector<Dest> out;
  for (uint32_t r = 0; r < n; ++r) {
    DQ_ASSIGN_OR_RETURN(kernels::BucketTransform b,
                        kernels::BucketTransform::Forward(codec, kernels::RoundInfo{round, r, n}, inputs[r], d));
    buckets.push_back(std::move(b));
  }
  for (kernels::BucketTransform& b : buckets) {
    in.push_back(b.source());
    out.push_back(b.dest());
  }
  DQ_ASSIGN_OR_RETURN(SimulationResult result, run(buckets.empty() ? d : buckets[0].size(), in, out));
  for (uint32_t r = 0; r < n; ++r) DQ_RETURN_IF_ERROR(buckets[r].InverseInto(outputs[r]));
  return result;
}

absl::StatusOr<SimulationResult> SimulateUntransformed(const Codec& codec, const Schedule& schedule, size_t d,
                                                       uint64_t round, absl::Span<const Source> inputs,
                                                       absl::Span<const Dest> outputs) {
  const int n = schedule.world_size;
  DQ_RETURN_IF_ERROR(CheckArguments(codec, schedule, inputs, outputs));
  SimulationResult result;
  result.bytes_sent.assign(n, 0);
  DQ_ASSIGN_OR_RETURN(const Statistics stats, ExchangeStats(codec, schedule, d, inputs, result));
  DQ_ASSIGN_OR_RETURN(const std::vector<BucketPlan> plans, MakePlans(codec, stats, d, round, 0));
  std::vector<Source> in(inputs.begin(), inputs.end());
  std::vector<Dest> out(outputs.begin(), outputs.end());
  for (int r = 0; r < n; ++r) Centre(plans[r], in[r], out[r]);
  if (!plans.empty()) result.widths = plans[0].widths;
  DQ_RETURN_IF_ERROR(RunSchedule(codec, schedule, plans, in, out, result));
  for (uint64_t b : result.bytes_sent) result.total_bytes_sent += b;
  return result;
}

absl::StatusOr<SimulationResult> SimulateHopBitsUntransformed(const Codec& codec, const Schedule& schedule, size_t d,
                                                              uint64_t round, absl::Span<const double> hop_bits,
                                                              absl::Span<const Source> inputs,
                                                              absl::Span<const Dest> outputs) {
  const int n = schedule.world_size;
  DQ_RETURN_IF_ERROR(CheckArguments(codec, schedule, inputs, outputs));
  if (static_cast<int>(hop_bits.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("need ", n, " hop budgets, got ", hop_bits.size()));
  }
  SimulationResult result;
  result.bytes_sent.assign(n, 0);
  DQ_ASSIGN_OR_RETURN(const Statistics stats, ExchangeStats(codec, schedule, d, inputs, result));
  std::map<double, std::vector<BucketPlan>> plans;  // per distinct b̄, every rank's plan
  for (double bits : hop_bits) {
    if (plans.count(bits) == 0) {
      DQ_ASSIGN_OR_RETURN(plans[bits], MakePlans(codec, stats, d, round, bits));
    }
  }
  auto plan = [&](int k, int rank) -> const BucketPlan& { return plans.at(hop_bits[k - 1])[rank]; };
  // The centring depends on the statistics only: the same in every b̄'s plan.
  std::vector<Source> in(inputs.begin(), inputs.end());
  std::vector<Dest> out(outputs.begin(), outputs.end());
  for (int r = 0; r < n; ++r) Centre(plan(n, r), in[r], out[r]);
  result.widths = plan(n, 0).widths;

  struct Held {  // a rank's fp32 partial sum of one chunk
    std::vector<float> acc;
    int summands = 0;
  };
  std::vector<std::map<int, Held>> held(n);  // [rank][chunk]
  auto hold = [&](int r, const kernels::ChunkRef& chunk) -> Held& {
    Held& h = held[r][static_cast<int>(chunk.chunk_id)];
    if (h.summands == 0) {
      h.acc.resize(chunk.count);
      kernels::LoadSource(in[r], chunk.begin, chunk.count, h.acc.data());
      h.summands = 1;
    }
    return h;
  };
  // Compresses rank r's partial sum of `chunk` at its summand count's b̄.
  auto compress = [&](int r, const kernels::ChunkRef& ref, std::vector<uint8_t>& bytes) -> absl::StatusOr<int> {
    Held& h = hold(r, ref);
    const BucketPlan& p = plan(h.summands, r);
    bytes.resize(codec.MaxEncodedBytes(p, ref));
    const Source acc{h.acc.data(), kernels::DType::kFloat32, ref.begin, nullptr};
    DQ_ASSIGN_OR_RETURN(const size_t size, codec.Compress(p, ref, acc, absl::MakeSpan(bytes)));
    bytes.resize(size);
    return h.summands;
  };
  for (const std::vector<Transfer>& step : schedule.reduce_scatter) {
    // Sends first; then each receiver decodes with the sender's b̄ (the summand count it knows from
    // the schedule) and adds: the non-fused form of the engines' DecompressAccumulateRecompress.
    std::vector<std::vector<uint8_t>> messages(step.size());
    std::vector<int> summands(step.size());
    for (size_t i = 0; i < step.size(); ++i) {
      const Transfer& t = step[i];
      const kernels::ChunkRef ref = SiblingRef(schedule, ChunkOf(d, n, t.chunk), t.chunk, t.from, t.to);
      DQ_ASSIGN_OR_RETURN(summands[i], compress(t.from, ref, messages[i]));
      held[t.from].erase(t.chunk);
      result.bytes_sent[t.from] += messages[i].size();
    }
    for (size_t i = 0; i < step.size(); ++i) {
      const Transfer& t = step[i];
      const kernels::ChunkRef chunk = ChunkOf(d, n, t.chunk);
      Held& h = hold(t.to, chunk);
      absl::Status s = codec.DecompressAccumulate(plan(summands[i], t.to), chunk, messages[i], h.acc.data());
      if (!s.ok()) return common::Annotate(s, absl::StrCat("rank ", t.to, ", chunk ", t.chunk));
      h.summands += summands[i];
    }
  }
  // Each owner's final compression, decoded by every rank; the all-gather forwards it unchanged.
  std::vector<std::vector<uint8_t>> final_bytes(n);
  for (int c = 0; c < n; ++c) {
    const int owner = schedule.owner[c];
    const kernels::ChunkRef chunk = ChunkOf(d, n, c);
    DQ_ASSIGN_OR_RETURN(const int k, compress(owner, chunk, final_bytes[c]));
    if (k != n) return absl::InternalError(absl::StrCat("chunk ", c, " ends with ", k, " of ", n, " summands"));
    if (n == 1) result.bytes_sent[0] += final_bytes[c].size();
    for (int r = 0; r < n; ++r) {
      absl::Status s = codec.Decompress(plan(n, r), chunk, final_bytes[c], out[r]);
      if (!s.ok()) return common::Annotate(s, absl::StrCat("rank ", r, ", final chunk ", c));
    }
  }
  for (const std::vector<Transfer>& step : schedule.all_gather) {
    for (const Transfer& t : step) result.bytes_sent[t.from] += final_bytes[t.chunk].size();
  }
  for (uint64_t b : result.bytes_sent) result.total_bytes_sent += b;
  return result;
}

}  // namespace

absl::StatusOr<SimulationResult> SimulateAllReduce(const Codec& codec, const Schedule& schedule, size_t d,
                                                   uint64_t round, absl::Span<const Source> inputs,
                                                   absl::Span<const Dest> outputs) {
  return WithBucketTransform(codec, d, round, inputs, outputs,
                             [&](size_t length, absl::Span<const Source> in, absl::Span<const Dest> out) {
                               return SimulateUntransformed(codec, schedule, length, round, in, out);
                             });
}

absl::StatusOr<SimulationResult> SimulateAllReduceHopBits(const Codec& codec, const Schedule& schedule, size_t d,
                                                          uint64_t round, absl::Span<const double> hop_bits,
                                                          absl::Span<const Source> inputs,
                                                          absl::Span<const Dest> outputs) {
  return WithBucketTransform(codec, d, round, inputs, outputs,
                             [&](size_t length, absl::Span<const Source> in, absl::Span<const Dest> out) {
                               return SimulateHopBitsUntransformed(codec, schedule, length, round, hop_bits, in, out);
                             });
}

double WireBitsPerCoord(const SimulationResult& result, size_t d, int n) {
  if (d == 0) return 0;
  const double messages_per_coord = n > 1 ? 2.0 * (n - 1) : 1.0;
  return 8.0 * static_cast<double>(result.total_bytes_sent) / (static_cast<double>(d) * messages_per_coord);
}

}  // namespace dynamiq::engine
