// `dynamiq-bench codec`: compression error and speed of every codec on a simulated multi-hop
// all-reduce (engine/simulator.h), on synthetic gradients or on the user's own float32 files.
#ifndef DQ_BENCH_CODEC_BENCH_H_
#define DQ_BENCH_CODEC_BENCH_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"

namespace dynamiq::bench {

struct CodecBenchOptions {
  std::vector<kernels::CodecConfig> configs;
  int workers = 8;
  std::string topology = "ring";
  size_t elements = 1 << 20;
  std::vector<std::string> inputs;  // one raw little-endian float32 file per worker; empty: synthetic
  double correlation = 0.5;         // synthetic data: share of variance common to all workers
  uint64_t seed = 1;
  int trials = 3;
  double min_seconds = 0.3;  // per throughput measurement; 0 skips throughput
  // Non-empty: each row writes rank 0's all-reduced result of its last trial (raw float32) to
  // <output_prefix>.<row index>.bin and, for DynamiQ, rank 0's code width per super-group (one
  // byte each) to <output_prefix>.<row index>.widths, for error breakdowns
  // (bench/corpus_breakdown.py).
  std::string output_prefix;
  // DynamiQ only: a b̄ per hop (engine/hop_budget.h) instead of one: empty (one b̄), "measured" (the
  // Lagrange rule HopBudgets on the data's partial-sum energies HopEnergies), "model" (on
  // HopEnergyModel with the data's RankCorrelation), each at the wire cost of the config's bits and
  // within the codec's 3..8; or n comma-separated b̄ values for k = 1..n summands (the config's
  // bits then unused).
  std::string hop_bits;
  double hop_tilt = 1.0;  // HopBudgets' tilt (1: the rule, 0: uniform)
};

struct CodecBenchRow {
  std::string codec;
  kernels::CodecConfig config;
  std::string description;
  std::string skipped;  // non-empty: why this codec was not run
  size_t elements = 0;  // per worker, as measured: --size's count or the --input files' length
  double wire_bits_per_coord = 0;
  double vnmse = 0;
  double compress_gbps = 0, decompress_gbps = 0, dar_gbps = 0;
  // Codecs with a whole-bucket transform (THC's rotation): GB/s of fp32 input (the bucket's d
  // elements) of ForwardTransform and of InverseTransform on one core; 0 for the others.
  double forward_transform_gbps = 0, inverse_transform_gbps = 0;
  bool identical = true;         // all ranks decoded bit-identical results
  std::vector<double> hop_bits;  // DynamiQ with CodecBenchOptions::hop_bits: b̄ per summand count
};

absl::StatusOr<std::vector<CodecBenchRow>> RunCodecBench(const CodecBenchOptions& options);

// `dynamiq-bench step-budget`: one DynamiQ bit budget per training step. Splits each config's b̄
// across a step's buckets (kernels::StepBudgets, clamped to [min_bits, max_bits]) from the buckets'
// per-rank files (`buckets[k]`: one float32 file per worker), computing and summing the statistics
// as the all-reduce does; dynamiqd would do the same with one step's reduced statistics and apply
// the budgets to the next step's buckets.
// Which per-super-group energy the split weighs: the all-reduce's statistics (the square of the sum
// of the ranks' norms: what MakePlan allocates with, known before the all-reduce) or the all-reduced
// result's (the squared norm of the sum: known after it, identical on every rank, e.g. from the
// previous step).
enum class StepEnergy { kStatistics, kResult };

struct StepBudgetRow {
  double bits_target = 0;  // the step's average b̄ (a config's bits)
  size_t bucket = 0;
  size_t elements = 0;
  double bits = 0;  // this bucket's b̄
};

absl::StatusOr<std::vector<StepBudgetRow>> PlanStepBudgets(const std::vector<std::vector<std::string>>& buckets,
                                                           int workers,
                                                           const std::vector<kernels::CodecConfig>& configs,
                                                           double min_bits, double max_bits,
                                                           StepEnergy energy = StepEnergy::kStatistics);

std::string FormatStepBudgetJson(const StepBudgetRow& row);

std::string FormatRowJson(const CodecBenchRow& row, const CodecBenchOptions& options);
std::string FormatTable(const std::vector<CodecBenchRow>& rows, const CodecBenchOptions& options);

}  // namespace dynamiq::bench

#endif  // DQ_BENCH_CODEC_BENCH_H_
