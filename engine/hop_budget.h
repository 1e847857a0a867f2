// A bit budget per hop of a multi-hop all-reduce (issue 20, round 3): a simulation study, not used
// by the network engines.
//
// Every coordinate is quantized once per aggregation-tree node: the partial sum of k contributions
// a node sends towards the chunk's owner (k = 1..n-1; in the ring one message per k, in the
// butterfly n / 2k messages of k = 1, 2, 4, ...), and the owner's final sum (k = n), compressed once
// and forwarded unchanged n - 1 times by the all-gather. With a b̄_k per k the wire cost is
// Σ_k messages_k b̄_k and the error about Σ_k compressions_k E_k 2^(-2 b̄_k) (E_k: squared norm of a
// k-summand partial sum), so bits are worth more where partial sums are large and less on the
// final sum, which is paid n - 1 times. Every rank knows k for each message (from the schedule), so
// a per-k b̄ keeps the plans identical on all ranks.
#ifndef DQ_ENGINE_HOP_BUDGET_H_
#define DQ_ENGINE_HOP_BUDGET_H_

#include <stddef.h>

#include <vector>

#include "absl/types/span.h"
#include "engine/schedule.h"

namespace dynamiq::engine {

// Per summand count k = 1..n (index k - 1), over all chunks of one bucket.
struct HopMessages {
  std::vector<int> compressions;  // quantizations of a k-summand partial sum
  std::vector<int> messages;      // wire messages carrying them (k = n: the n - 1 forwards per chunk)
};

// What the schedule's reduce-scatter and all-gather send, by summand count. n == 1: one
// compression and one "message" of k = 1 (as WireBitsPerCoord counts it).
HopMessages CountHopMessages(const Schedule& schedule);

// E_k: the mean squared norm of the k-summand partial sums the schedule compresses, summed exactly
// (fp64) from inputs[r] (d values each) minus subtract[j] per super-group j (DynamiQ's centring;
// empty: none). 0 for a k the schedule never compresses.
std::vector<double> HopEnergies(const Schedule& schedule, size_t d, absl::Span<const std::vector<float>> inputs,
                                absl::Span<const float> subtract);

// The same from a model of n exchangeable ranks with pairwise correlation rho:
// E_k = k + k (k - 1) rho (1 per rank's energy; only ratios matter).
std::vector<double> HopEnergyModel(int world_size, double rho);

// rho of that model from the data: (||Σ_r x_r||² / Σ_r ||x_r||² - 1) / (n - 1), clamped to
// [-1 / (n - 1), 1]; centred like HopEnergies. 0 for n == 1 or all-zero inputs.
double RankCorrelation(size_t d, absl::Span<const std::vector<float>> inputs, absl::Span<const float> subtract);

// The Lagrange rule: b̄_k minimising Σ_k compressions_k E_k 2^(-2 b̄_k) at the wire cost of
// `mean_bits` everywhere (Σ_k messages_k b̄_k = mean_bits Σ_k messages_k), each in
// [min_bits, max_bits]: b̄_k = clamp(C + tilt / 2 · log2(compressions_k E_k / messages_k)), C found
// by bisection. tilt 1 is the rule, 0 uniform (a knob to check the rule's optimum on real error
// curves). A k that is never compressed gets mean_bits (unused); a zero E_k gets min_bits. If the
// clamps make mean_bits unreachable every b̄_k is the nearest bound.
std::vector<double> HopBudgets(const HopMessages& hops, absl::Span<const double> energies, double mean_bits,
                               double min_bits, double max_bits, double tilt = 1.0);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_HOP_BUDGET_H_
