#include "kernels/dynamiq_levels.h"

#include <cmath>
#include <cstring>

#include "common/status_macros.h"

namespace dynamiq::kernels {

double DefaultMeeEpsilon(int bits) {
  // 2, 4, 8: the authors' CUDA kernel; the widths in between are interpolated.
  static constexpr double kEps[9] = {0, 0, 0.23, 0.20, 0.18, 0.15, 0.12, 0.11, 0.10};
  return kEps[bits];
}

LevelTable BuildLevelTable(int bits, LevelKind kind, double eps) {
  DQ_CHECK(bits >= kMinWidth && bits <= kMaxWidth);
  DQ_CHECK(kind != LevelKind::kAuto);
  LevelTable t;
  std::memset(&t, 0, sizeof(t));
  t.bits = bits;
  const int L = (1 << (bits - 1)) - 1;
  t.max_level = L;
  t.uniform = kind == LevelKind::kUniform ? 1 : 0;
  const float inv_L = 1.0f / static_cast<float>(L);
  const double a = 1.0 + 2.0 * eps * eps;
  for (int r = 0; r <= L; ++r) {
    // Uniform levels use exactly the expression the SIMD/CUDA kernels compute: r * (1/L) in float.
    t.level[r] =
        t.uniform ? static_cast<float>(r) * inv_L : static_cast<float>((std::pow(a, r) - 1.0) / (std::pow(a, L) - 1.0));
  }
  if (!t.uniform) t.level[L] = 1.0f;
  for (int r = 0; r < L; ++r) {
    DQ_CHECK(t.level[r + 1] > t.level[r]);
    // At most one level boundary per search bucket keeps QuantizeElement's search to one step.
    DQ_CHECK((t.level[r + 1] - t.level[r]) * kSearchBuckets >= 1.0f);
    t.inv_gap[r] = 1.0f / (t.level[r + 1] - t.level[r]);
  }
  for (int code = 0; code <= 2 * L; ++code) {
    int q = code - L;
    t.decode[code] = q < 0 ? -t.level[-q] : t.level[q];
  }
  int r = 0;
  for (int i = 0; i < kSearchBuckets; ++i) {
    const float x = static_cast<float>(i) / kSearchBuckets;
    while (r < L - 1 && t.level[r + 1] <= x) ++r;
    t.search[i] = r;
  }
  return t;
}

}  // namespace dynamiq::kernels
