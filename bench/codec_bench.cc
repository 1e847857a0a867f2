#include "bench/codec_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/synthetic_gradients.h"
#include "common/status_macros.h"
#include "engine/hop_budget.h"
#include "engine/schedule.h"
#include "engine/simulator.h"
#include "kernels/codec_registry.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/dynamiq_allocator.h"

namespace dynamiq::bench {
namespace {

using kernels::Codec;
using kernels::CodecConfig;
using kernels::CodecId;

absl::StatusOr<std::vector<std::vector<float>>> LoadInputs(const CodecBenchOptions& o) {
  if (o.inputs.empty()) {
    SyntheticOptions s;
    s.workers = o.workers;
    s.elements = o.elements;
    s.correlation = o.correlation;
    s.seed = o.seed;
    return SyntheticGradients(s);
  }
  if (static_cast<int>(o.inputs.size()) != o.workers) {
    return absl::InvalidArgumentError(absl::StrCat("--input names ", o.inputs.size(), " files but --workers is ",
                                                   o.workers, " (one file per worker)"));
  }
  return ReadFloatFiles(o.inputs);
}

// Runs `fn` until at least `min_seconds` have passed; returns seconds per call.
template <typename Fn>
absl::StatusOr<double> TimePerCall(double min_seconds, Fn&& fn) {
  using Clock = std::chrono::steady_clock;
  DQ_RETURN_IF_ERROR(fn());  // warm-up
  int calls = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  do {
    DQ_RETURN_IF_ERROR(fn());
    ++calls;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < min_seconds && calls < 100000);
  return elapsed / calls;
}

// Single-core throughput of the three chunk operations on worker 0's data, as one chunk.
absl::Status MeasureThroughput(const Codec& codec, const std::vector<std::vector<float>>& inputs,
                               const CodecBenchOptions& o, CodecBenchRow& row) {
  const size_t d = inputs[0].size();
  const int n = static_cast<int>(inputs.size());
  std::vector<float> stats(codec.StatsLength(d));
  kernels::Source local{inputs[0].data(), kernels::DType::kFloat32, 0, nullptr};
  kernels::Source neighbour{inputs[n > 1 ? 1 : 0].data(), kernels::DType::kFloat32, 0, nullptr};
  codec.ComputeStats(local, d, stats.data());
  DQ_ASSIGN_OR_RETURN(kernels::BucketPlan plan,
                      codec.MakePlan(kernels::RoundInfo{7, 0, static_cast<uint32_t>(n)}, d, stats, stats));
  if (!plan.local_means.empty()) local.subtract_per_group = neighbour.subtract_per_group = plan.local_means.data();
  const kernels::ChunkRef chunk{0, 0, d};
  std::vector<uint8_t> in(codec.MaxEncodedBytes(plan, chunk)), out(in.size());
  std::vector<float> decoded(d);
  kernels::Dest dest{decoded.data(), kernels::DType::kFloat32, 0, nullptr};
  DQ_ASSIGN_OR_RETURN(size_t in_bytes, codec.Compress(plan, chunk, neighbour, absl::MakeSpan(in)));
  const absl::Span<const uint8_t> message(in.data(), in_bytes);
  DQ_ASSIGN_OR_RETURN(double t_c, TimePerCall(o.min_seconds, [&]() -> absl::Status {
                        return codec.Compress(plan, chunk, local, absl::MakeSpan(out)).status();
                      }));
  DQ_ASSIGN_OR_RETURN(double t_d, TimePerCall(o.min_seconds, [&]() -> absl::Status {
                        return codec.Decompress(plan, chunk, message, dest);
                      }));
  DQ_ASSIGN_OR_RETURN(
      double t_dar, TimePerCall(o.min_seconds, [&]() -> absl::Status {
        return codec.DecompressAccumulateRecompress(plan, chunk, message, local, absl::MakeSpan(out)).status();
      }));
  const double gb = 4.0 * d / 1e9;
  row.compress_gbps = gb / t_c;
  row.decompress_gbps = gb / t_d;
  row.dar_gbps = gb / t_dar;
  if (codec.NeedsBucketTransform()) {
    // The rotation runs on the padded bucket; it is linear, so the values it starts from do not
    // change its time.
    DQ_ASSIGN_OR_RETURN(const size_t length, codec.TransformedLength(d));
    std::vector<float> rotated(length, 0.0f);
    std::copy(inputs[0].begin(), inputs[0].end(), rotated.begin());
    const kernels::RoundInfo round{7, 0, static_cast<uint32_t>(n)};
    DQ_ASSIGN_OR_RETURN(double t_f, TimePerCall(o.min_seconds, [&]() -> absl::Status {
                          return codec.ForwardTransform(round, absl::MakeSpan(rotated));
                        }));
    DQ_ASSIGN_OR_RETURN(double t_i, TimePerCall(o.min_seconds, [&]() -> absl::Status {
                          return codec.InverseTransform(round, absl::MakeSpan(rotated));
                        }));
    row.forward_transform_gbps = gb / t_f;
    row.inverse_transform_gbps = gb / t_i;
  }
  return absl::OkStatus();
}

// The b̄ per summand count for CodecBenchOptions::hop_bits.
absl::StatusOr<std::vector<double>> HopBits(const Codec& codec, const engine::Schedule& schedule,
                                            const std::vector<std::vector<float>>& inputs, const CodecBenchOptions& o) {
  const int n = schedule.world_size;
  const size_t d = inputs[0].size();
  const kernels::CodecInfo& info = kernels::GetCodecInfo(codec.id());
  if (o.hop_bits != "measured" && o.hop_bits != "model") {
    std::vector<double> bits;
    for (absl::string_view b : absl::StrSplit(o.hop_bits, ',')) {
      double v = 0;
      if (!absl::SimpleAtod(b, &v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--hop_bits: '", b, "' is neither measured, model nor a number"));
      }
      DQ_RETURN_IF_ERROR(kernels::CheckCodecBits(codec.id(), v));
      bits.push_back(v);
    }
    if (static_cast<int>(bits.size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("--hop_bits: need ", n, " values (one per summand count), got ", bits.size()));
    }
    return bits;
  }
  // DynamiQ's centring (the plan's per-super-group mean), from statistics summed in rank order.
  std::vector<float> local(codec.StatsLength(d)), reduced(local.size(), 0.0f);
  for (const std::vector<float>& x : inputs) {
    codec.ComputeStats(kernels::Source{x.data(), kernels::DType::kFloat32, 0, nullptr}, d, local.data());
    for (size_t i = 0; i < local.size(); ++i) reduced[i] += local[i];
  }
  DQ_ASSIGN_OR_RETURN(const kernels::BucketPlan plan,
                      codec.MakePlan(kernels::RoundInfo{0, 0, static_cast<uint32_t>(n)}, d, local, reduced));
  const std::vector<double> energies =
      o.hop_bits == "measured" ? engine::HopEnergies(schedule, d, inputs, plan.local_means)
                               : engine::HopEnergyModel(n, engine::RankCorrelation(d, inputs, plan.local_means));
  return engine::HopBudgets(engine::CountHopMessages(schedule), energies, codec.config().bits, info.min_bits,
                            info.max_bits, o.hop_tilt);
}

}  // namespace

absl::StatusOr<std::vector<CodecBenchRow>> RunCodecBench(const CodecBenchOptions& o) {
  DQ_ASSIGN_OR_RETURN(engine::Topology topology, engine::ParseTopology(o.topology));
  DQ_ASSIGN_OR_RETURN(engine::Schedule schedule, engine::MakeSchedule(topology, o.workers));
  DQ_ASSIGN_OR_RETURN(auto inputs, LoadInputs(o));
  const size_t d = inputs[0].size();
  std::vector<std::vector<double>> exact;  // per trial
  std::vector<CodecBenchRow> rows;
  for (const CodecConfig& config : o.configs) {
    DQ_ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, kernels::CreateCodec(config));
    CodecBenchRow row;
    row.codec = std::string(kernels::CodecName(config.id));
    row.config = config;
    row.description = codec->Describe();
    row.elements = d;
    if (topology != engine::Topology::kRing && !codec->SupportsButterfly()) {
      row.skipped = absl::StrCat("codec does not support ", engine::TopologyName(topology));
      rows.push_back(row);
      continue;
    }
    if (!o.hop_bits.empty() && config.id == CodecId::kDynamiq) {
      DQ_ASSIGN_OR_RETURN(row.hop_bits, HopBits(*codec, schedule, inputs, o));
    }
    double vnmse_sum = 0, bits_sum = 0;
    std::vector<std::vector<float>> outputs(o.workers, std::vector<float>(d));
    std::vector<uint8_t> widths;
    for (int trial = 0; trial < o.trials; ++trial) {
      std::vector<kernels::Source> in;
      std::vector<kernels::Dest> out;
      for (int r = 0; r < o.workers; ++r) {
        in.push_back(kernels::Source{inputs[r].data(), kernels::DType::kFloat32, 0, nullptr});
        out.push_back(kernels::Dest{outputs[r].data(), kernels::DType::kFloat32, 0, nullptr});
      }
      DQ_ASSIGN_OR_RETURN(engine::SimulationResult sim,
                          row.hop_bits.empty() ? engine::SimulateAllReduce(*codec, schedule, d, 1000 + trial, in, out)
                                               : engine::SimulateAllReduceHopBits(*codec, schedule, d, 1000 + trial,
                                                                                  row.hop_bits, in, out));
      if (exact.empty()) exact.push_back(ExactSum(inputs));
      widths = sim.widths;
      vnmse_sum += Vnmse(outputs[0].data(), exact[0]);
      bits_sum += engine::WireBitsPerCoord(sim, d, o.workers);
      for (int r = 1; r < o.workers; ++r) {
        if (std::memcmp(outputs[r].data(), outputs[0].data(), d * sizeof(float)) != 0) row.identical = false;
      }
    }
    if (!o.output_prefix.empty()) {
      const std::string path = absl::StrCat(o.output_prefix, ".", rows.size(), ".bin");
      std::ofstream f(path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(outputs[0].data()), static_cast<std::streamsize>(d * sizeof(float)));
      if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
      if (!widths.empty()) {  // DynamiQ: the code width of every super-group, one byte each
        std::ofstream w(absl::StrCat(o.output_prefix, ".", rows.size(), ".widths"), std::ios::binary);
        w.write(reinterpret_cast<const char*>(widths.data()), static_cast<std::streamsize>(widths.size()));
        if (!w) return absl::InternalError(absl::StrCat("cannot write the widths next to ", path));
      }
    }
    row.vnmse = vnmse_sum / o.trials;
    row.wire_bits_per_coord = bits_sum / o.trials;
    if (o.min_seconds > 0) DQ_RETURN_IF_ERROR(MeasureThroughput(*codec, inputs, o, row));
    rows.push_back(row);
  }
  return rows;
}

absl::StatusOr<std::vector<StepBudgetRow>> PlanStepBudgets(const std::vector<std::vector<std::string>>& buckets,
                                                           int workers, const std::vector<CodecConfig>& configs,
                                                           double min_bits, double max_bits, StepEnergy energy) {
  if (buckets.empty()) return absl::InvalidArgumentError("step-budget needs at least one bucket");
  if (!(min_bits <= max_bits)) return absl::InvalidArgumentError("--min_bits is above --max_bits");
  std::vector<StepBudgetRow> rows;
  for (const CodecConfig& config : configs) {
    if (config.id != CodecId::kDynamiq) continue;
    DQ_ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, kernels::CreateCodec(config));
    const auto* dq = dynamic_cast<const kernels::DynamiqCodec*>(codec.get());
    if (dq == nullptr) return absl::InternalError("the dynamiq codec is not a DynamiqCodec");
    std::vector<std::vector<double>> energies;
    std::vector<size_t> sizes;
    for (const std::vector<std::string>& files : buckets) {
      CodecBenchOptions load;
      load.workers = workers;
      load.inputs = files;
      DQ_ASSIGN_OR_RETURN(auto inputs, LoadInputs(load));
      const size_t d = inputs[0].size();
      if (energy == StepEnergy::kResult) {
        const std::vector<double> sum = ExactSum(inputs);
        std::vector<double> e((d + kernels::kSuperGroupSize - 1) / kernels::kSuperGroupSize, 0.0);
        for (size_t i = 0; i < d; ++i) e[i / kernels::kSuperGroupSize] += sum[i] * sum[i];
        energies.push_back(std::move(e));
      } else {
        // Summed in rank order, as the statistics exchange does.
        std::vector<float> local(codec->StatsLength(d)), reduced(local.size(), 0.0f);
        for (const std::vector<float>& x : inputs) {
          codec->ComputeStats(kernels::Source{x.data(), kernels::DType::kFloat32, 0, nullptr}, d, local.data());
          for (size_t i = 0; i < local.size(); ++i) reduced[i] += local[i];
        }
        energies.push_back(kernels::EnergiesFromStats(reduced));
      }
      sizes.push_back(d);
    }
    const std::vector<double> shares =
        kernels::StepBudgets(energies, sizes, config.bits, min_bits, max_bits, config.allocator, dq->width_errors());
    for (size_t k = 0; k < shares.size(); ++k) rows.push_back(StepBudgetRow{config.bits, k, sizes[k], shares[k]});
  }
  return rows;
}

std::string FormatStepBudgetJson(const StepBudgetRow& r) {
  return absl::StrFormat(R"({"bits_target":%.4g,"bucket":%d,"elements":%d,"bits":%.6f})", r.bits_target, r.bucket,
                         r.elements, r.bits);
}

std::string FormatRowJson(const CodecBenchRow& r, const CodecBenchOptions& o) {
  if (!r.skipped.empty()) {
    return absl::StrFormat(R"({"codec":"%s","skipped":"%s"})", r.codec, r.skipped);
  }
  const std::string hops =
      r.hop_bits.empty()
          ? ""
          : absl::StrFormat(R"("hop_bits":[%s],)", absl::StrJoin(r.hop_bits, ",", [](std::string* s, double b) {
                              absl::StrAppendFormat(s, "%.4f", b);
                            }));
  return absl::StrFormat(
      R"({"codec":"%s","bits_target":%.4g,"workers":%d,"topology":"%s","elements":%d,"wire_bits_per_coord":%.4f,)"
      R"("vnmse":%.6g,"compress_gbps":%.3f,"decompress_gbps":%.3f,"dar_gbps":%.3f,"identical_on_all_ranks":%s,)"
      R"(%s%s"description":"%s"})",
      r.codec, r.config.bits, o.workers, o.topology, r.elements, r.wire_bits_per_coord, r.vnmse, r.compress_gbps,
      r.decompress_gbps, r.dar_gbps, r.identical ? "true" : "false", hops,
      r.forward_transform_gbps > 0 ? absl::StrFormat(R"("forward_transform_gbps":%.3f,"inverse_transform_gbps":%.3f,)",
                                                     r.forward_transform_gbps, r.inverse_transform_gbps)
                                   : "",
      r.description);
}

std::string FormatTable(const std::vector<CodecBenchRow>& rows, const CodecBenchOptions& o) {
  // The loaded files' length, not --size, when the data came from --input.
  const size_t elements = rows.empty() ? o.elements : rows[0].elements;
  std::string s = absl::StrFormat("# %d workers, %s, %d elements per worker, %d trial(s)\n", o.workers, o.topology,
                                  elements, o.trials);
  absl::StrAppendFormat(&s, "%-11s %9s %10s %12s %10s %10s %10s %s\n", "codec", "bits", "wire_bits", "vnmse",
                        "comp_GB/s", "decomp_GB/s", "DAR_GB/s", "identical");
  for (const CodecBenchRow& r : rows) {
    if (!r.skipped.empty()) {
      absl::StrAppendFormat(&s, "%-11s (skipped: %s)\n", r.codec, r.skipped);
      continue;
    }
    const kernels::CodecInfo& info = kernels::GetCodecInfo(r.config.id);
    const bool has_bits = info.has_bits && info.min_bits < info.max_bits;
    absl::StrAppendFormat(&s, "%-11s %9s %10.3f %12.4e %10.2f %10.2f %10.2f %s\n", r.codec,
                          has_bits ? absl::StrFormat("%.3g", r.config.bits) : "-", r.wire_bits_per_coord, r.vnmse,
                          r.compress_gbps, r.decompress_gbps, r.dar_gbps, r.identical ? "yes" : "NO");
  }
  for (const CodecBenchRow& r : rows) {
    if (r.forward_transform_gbps > 0) {
      absl::StrAppendFormat(&s, "# %s: whole-bucket transform %.2f GB/s forward, %.2f GB/s inverse (one core)\n",
                            r.codec, r.forward_transform_gbps, r.inverse_transform_gbps);
    }
  }
  return s;
}

}  // namespace dynamiq::bench
