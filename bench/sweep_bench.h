// `dynamiq-bench sweep`: an nccl-tests-style size sweep of the engine's all-reduce. `world_size`
// ranks run as threads of this process, each with a real host transport (tcp or gloo over
// loopback, connected through an in-process store), and all-reduce the same synthetic gradients at
// every size from `min_bytes` to `max_bytes` (times `factor` each step), for every codec and
// schedule asked for. Per point: the median over timed iterations of the slowest rank's time (the
// collective's), algorithm and bus bandwidth on the uncompressed size (nccl-tests' definitions),
// the bytes each rank sent, and the error against the exact sum.
#ifndef DQ_BENCH_SWEEP_BENCH_H_
#define DQ_BENCH_SWEEP_BENCH_H_

#include <stddef.h>
#include <stdint.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/codec.h"

namespace dynamiq::bench {

struct SweepOptions {
  int world_size = 2;
  std::string transport = "tcp";                   // engine/host_transport.h names
  std::vector<std::string> topologies = {"ring"};  // engine::ParseTopology names
  std::vector<kernels::CodecConfig> codecs;        // each with its bits
  size_t min_bytes = 8;                            // fp32 bytes per rank, rounded down to whole floats (>= 1)
  size_t max_bytes = size_t{64} << 20;
  int factor = 4;  // size step
  // Timed iterations per point: `max_iterations` for small sizes, fewer as the size grows (about
  // 256 MiB of input per point), never under `min_iterations`; after `warmup` untimed ones.
  int min_iterations = 5;
  int max_iterations = 50;
  int warmup = 2;
  size_t block_elements = size_t{4} << 20;  // engine::AllReduceOptions::block_elements
  absl::Duration timeout = absl::Seconds(60);
  uint64_t seed = 1;
};

struct SweepPoint {
  std::string codec;     // kernels::CodecName
  double bits = 0;       // the codec's bits setting (0: none)
  std::string topology;  // ring, butterfly, two_shot
  size_t bytes = 0;      // fp32 bytes per rank
  size_t elements = 0;
  int iterations = 0;
  double median_us = 0, p99_us = 0;       // of the slowest rank's time per iteration
  double algbw_gbps = 0, busbw_gbps = 0;  // GB/s on `bytes`
  uint64_t wire_bytes_per_rank = 0;       // sent by rank 0 in the last iteration, headers included
  double vnmse = 0;                       // rank 0's result against the exact sum
};

// Runs the sweep; `on_point` hears each point as it is measured. Fails on the first failed
// all-reduce (every rank stops).
absl::StatusOr<std::vector<SweepPoint>> RunSweep(const SweepOptions& options,
                                                 const std::function<void(const SweepPoint&)>& on_point);

std::string FormatSweepJson(const SweepPoint& point, const SweepOptions& options);
// The table's header line and one row.
std::string SweepTableHeader();
std::string FormatSweepRow(const SweepPoint& point);

}  // namespace dynamiq::bench

#endif  // DQ_BENCH_SWEEP_BENCH_H_
