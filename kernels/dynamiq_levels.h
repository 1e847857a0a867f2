// Builds DynamiQ's per-width level tables (host only; GPUs receive copies, so every device
// quantizes against bit-identical tables).
#ifndef DQ_KERNELS_DYNAMIQ_LEVELS_H_
#define DQ_KERNELS_DYNAMIQ_LEVELS_H_

#include "kernels/codec.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::kernels {

// The MEE spacing parameter per width: 2 -> 0.23, 4 -> 0.18, 8 -> 0.10 as in the authors' CUDA
// kernel, interpolated for 3, 5, 6, 7.
double DefaultMeeEpsilon(int bits);

// Levels f(r) = ((1 + 2 eps^2)^r - 1) / ((1 + 2 eps^2)^L - 1) for kMee, r / L for kUniform, r = 0..L.
// DQ_CHECKs that the interval-search table resolves every level (true for the defaults).
LevelTable BuildLevelTable(int bits, LevelKind kind, double eps);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_DYNAMIQ_LEVELS_H_
