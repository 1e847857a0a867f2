// Synthetic gradient-like data for codec benchmarks and tests (DynamiQ paper, Table 7, plus
// correlation between workers as in real data-parallel training):
//   every 256-element super-group j draws a magnitude M_j from a log-normal mixture
//   (weight .79: ln M ~ N(-3.99, 1.22^2); weight .21: ln M ~ N(-16.41, 4.63^2)), so about a fifth of
//   the super-groups are orders of magnitude smaller than the median, as in LLM gradients;
//   worker i's element k is M_j / 16 * (sqrt(rho) z_k + sqrt(1 - rho) z_ik) with standard normal
//   z's: a component shared by all workers plus a private one (rho = 0.5 by default).
//   magnitude_sigma sets the 1.22: a smaller spread spreads the energy over more super-groups, so
//   DynamiQ's allocator cannot concentrate the bits, and the error at a given budget grows (about
//   10x at 5 bits for 0.5).
// Deterministic for a given seed and step. `step` redraws the normal values (shared and private) but
// keeps the magnitudes (up to magnitude_sigma): consecutive steps of one model, whose gradients keep
// their per-layer scales while the values change.
#ifndef DQ_BENCH_SYNTHETIC_GRADIENTS_H_
#define DQ_BENCH_SYNTHETIC_GRADIENTS_H_

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dynamiq::bench {

struct SyntheticOptions {
  int workers = 8;
  size_t elements = 1 << 20;
  double correlation = 0.5;       // rho
  double magnitude_sigma = 1.22;  // ln-sd of the main magnitude component
  uint64_t seed = 1;
  uint64_t step = 0;
};

// workers x elements values.
std::vector<std::vector<float>> SyntheticGradients(const SyntheticOptions& options);

// Exact (double precision) elementwise sum of the workers' vectors.
std::vector<double> ExactSum(const std::vector<std::vector<float>>& inputs);

// ||approx - exact||^2 / ||exact||^2 over exact's elements.
double Vnmse(const float* approx, absl::Span<const double> exact);

// The benchmarks' summaries of timings: the median (the mean of the middle two for an even count)
// and the p-th percentile (the sample at index floor(p / 100 * size)); 0 for no samples.
double Median(std::vector<double> samples);
double Percentile(std::vector<double> samples, double p);

// Raw little-endian float32 files, one per worker, all of the same length (--input of the
// benchmarks: real gradients, e.g. bench/dump_gradients.py's).
absl::StatusOr<std::vector<std::vector<float>>> ReadFloatFiles(const std::vector<std::string>& paths);

}  // namespace dynamiq::bench

#endif  // DQ_BENCH_SYNTHETIC_GRADIENTS_H_
