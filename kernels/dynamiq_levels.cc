#include "kernels/dynamiq_levels.h"

#include <cmath>
#include <cstring>

#include "common/status_macros.h"

namespace dynamiq::kernels {

double DefaultMeeEpsilon(int bits) { return bits == 2 ? 0.23 : (bits == 4 ? 0.18 : 0.10); }

LevelTable BuildLevelTable(int bits, LevelKind kind, double eps) {
  DQ_CHECK(bits == 2 || bits == 4 || bits == 8);
  LevelTable t;
  std::memset(&t, 0, sizeof(t));
  t.bits = bits;
  const int L = (1 << (bits - 1)) - 1;
  t.max_level = L;
  const double a = 1.0 + 2.0 * eps * eps;
  for (int r = 0; r <= L; ++r) {
    double f = kind == LevelKind::kMee ? (std::pow(a, r) - 1.0) / (std::pow(a, L) - 1.0) : double(r) / L;
    t.level[r] = static_cast<float>(f);
  }
  t.level[L] = 1.0f;
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
