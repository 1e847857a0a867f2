// DynamiQ bit allocation: which code width each super-group gets so that the bucket meets an
// average budget of `bits_per_coord` including all metadata.
//
// Cost of a super-group of 256 elements on the wire, in bits:
//   width w > 0: 256 w codes + 16 x 8 group scales + 16 super unit = 256 w + 144
//   always:      4 (width map) + 32 (bf16 mean and norm statistics)
// Super-groups whose reduced energy is exactly zero (all ranks hold zeros) get width 0 with the
// measured allocator: they cost only the width map and statistics and decode exactly.
//
// kPaper: the paper's rule. Widths {2, 4, 8}; 8 bits if F >= tau, 4 if F >= 17/512 tau, else 2
//   (F = the super-group's energy; the ratio assumes each extra bit quarters the error), with tau
//   bisected to fit the budget.
// kMeasured: ours. Widths 2..8 with the quantizer's measured relative error per width: minimises
//   the total expected error sum_j F_j err(w_j) under the budget. Lagrangian relaxation on the
//   lower convex hull of (bits, error) gives energy thresholds; the multiplier is bisected to fit
//   the budget, and the leftover is spent greedily on the upgrades that remove the most error per
//   bit.
// Deterministic: identical inputs give identical widths on every rank.
#ifndef DQ_KERNELS_DYNAMIQ_ALLOCATOR_H_
#define DQ_KERNELS_DYNAMIQ_ALLOCATOR_H_

#include <stdint.h>

#include <array>
#include <vector>

#include "absl/types/span.h"
#include "kernels/codec.h"

namespace dynamiq::kernels {

inline constexpr double kFixedBitsPerSuperGroup = 4 + 32;

// Bits of a full super-group's payload at `width` (0 for width 0).
double SuperGroupPayloadBits(int width);

// Relative squared error (E||Q(x) - x||^2 / ||x||^2) of one quantization, indexed by width
// (entries 2..8 used).
using WidthErrors = std::array<double, 9>;

struct Allocation {
  std::vector<uint8_t> widths;
  double bits_per_coord = 0;  // achieved, metadata included
};

// Per-super-group energies from a bucket's reduced statistics ((mean, norm) pairs summed over the
// ranks, as DynamiqCodec::MakePlan reads them): the squared norm, +inf where it is not finite.
std::vector<double> EnergiesFromStats(absl::Span<const float> reduced_stats);

// Super-group indices by energy, descending; equal energies by index (so every rank agrees).
// Energies are >= 0 (+inf allowed, no NaN).
std::vector<uint32_t> ByEnergyDescending(absl::Span<const double> energy);

// `energy[j]` >= 0 per super-group; `num_elements` the bucket size.
Allocation AllocateWidths(absl::Span<const double> energy, size_t num_elements, double bits_per_coord,
                          BitAllocator allocator, const WidthErrors& errors);

// One bit budget per step. A training step all-reduces several buckets, and a per-bucket budget
// gives each bucket the same b̄ however much of the step's energy it holds. StepBudgets splits
// `bits_per_coord`, the average over all elements of the step, across the buckets as AllocateWidths
// would allocate the step's super-groups all at once (equal error removed per bit everywhere), and
// returns each bucket's b̄ (metadata included, per element of that bucket). A share outside
// [min_bits, max_bits] (what the codec accepts) is clamped and the rest of the budget re-split among
// the other buckets. `energies[k]` are bucket k's per-super-group energies (EnergiesFromStats; e.g.
// the previous step's reduced statistics, which every rank holds identically), `num_elements[k]`
// its size (> 0). Deterministic: identical inputs give identical budgets on every rank. The shares
// average to at most `bits_per_coord` (element-weighted) unless clamping at `min_bits` forces more.
std::vector<double> StepBudgets(absl::Span<const std::vector<double>> energies, absl::Span<const size_t> num_elements,
                                double bits_per_coord, double min_bits, double max_bits, BitAllocator allocator,
                                const WidthErrors& errors);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_DYNAMIQ_ALLOCATOR_H_
