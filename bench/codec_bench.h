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
  bool identical = true;  // all ranks decoded bit-identical results
};

absl::StatusOr<std::vector<CodecBenchRow>> RunCodecBench(const CodecBenchOptions& options);

std::string FormatRowJson(const CodecBenchRow& row, const CodecBenchOptions& options);
std::string FormatTable(const std::vector<CodecBenchRow>& rows, const CodecBenchOptions& options);

}  // namespace dynamiq::bench

#endif  // DQ_BENCH_CODEC_BENCH_H_
