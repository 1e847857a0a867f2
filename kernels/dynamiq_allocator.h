// DynamiQ bit allocation: which code width (2, 4 or 8 bits) each super-group gets so that the
// bucket meets an average budget of `bits_per_coord` including all metadata.
//
// Cost of a super-group of 256 elements on the wire, in bits:
//   width w > 0: 256 w codes + 16 x 8 group scales + 16 super unit = 256 w + 144
//   always:      2 (width map) + 32 (bf16 mean and norm statistics)
// Super-groups whose reduced energy is exactly zero (all ranks hold zeros) get width 0 with the
// measured allocator: they cost only the width map and statistics and decode exactly.
//
// Both allocators are threshold rules on the super-group energy F (squared sum of the ranks'
// norms): 8 bits if F >= tau, 4 if F >= rho * tau, else 2, with tau bisected to fit the budget.
//   kPaper:    rho = 17/512, from the paper's assumption that each extra bit quarters the error.
//   kMeasured: rho from the quantizer's measured error per width (equal marginal error reduction
//              per bit), then the leftover budget is spent greedily on the best remaining upgrades.
// Deterministic: identical inputs give identical widths on every rank.
#ifndef DQ_KERNELS_DYNAMIQ_ALLOCATOR_H_
#define DQ_KERNELS_DYNAMIQ_ALLOCATOR_H_

#include <stdint.h>

#include <array>
#include <vector>

#include "absl/types/span.h"
#include "kernels/codec.h"

namespace dynamiq::kernels {

inline constexpr double kFixedBitsPerSuperGroup = 2 + 32;

// Bits of a full super-group's payload at `width` (0 for width 0).
double SuperGroupPayloadBits(int width);

// Relative squared error (E||Q(x) - x||^2 / ||x||^2) of one quantization at width 2, 4, 8.
using WidthErrors = std::array<double, 3>;

struct Allocation {
  std::vector<uint8_t> widths;
  double bits_per_coord = 0;  // achieved, metadata included
};

// `energy[j]` >= 0 per super-group; `num_elements` the bucket size.
Allocation AllocateWidths(absl::Span<const double> energy, size_t num_elements, double bits_per_coord,
                          BitAllocator allocator, const WidthErrors& errors);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_DYNAMIQ_ALLOCATOR_H_
