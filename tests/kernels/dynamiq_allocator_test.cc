#include "kernels/dynamiq_allocator.h"

#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "kernels/random_math.h"

namespace dynamiq::kernels {
namespace {

// The order a comparison sort gives: energy descending, ties by index.
std::vector<uint32_t> Reference(const std::vector<double>& energy) {
  std::vector<uint32_t> order(energy.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return energy[a] > energy[b]; });
  return order;
}

TEST(ByEnergyDescendingTest, EqualsComparisonSortWithTiesByIndex) {
  for (size_t m : {size_t{0}, size_t{1}, size_t{2}, size_t{300}, size_t{70000}}) {
    std::vector<double> energy(m);
    for (size_t i = 0; i < m; ++i) {
      const uint32_t r = RandomBits(StreamKey(9, 0, 0), static_cast<uint32_t>(i));
      // Squared bf16 norms as MakePlan makes them, with many ties, zeros, -0, huge and +inf.
      const double norm =
          Bf16ToFloat(FloatToBf16(std::ldexp(static_cast<float>(r % 1000) / 7.0f, (r >> 10) % 60 - 30)));
      energy[i] = norm * norm;
      if (r % 17 == 0) energy[i] = 0.0;
      if (r % 19 == 0) energy[i] = -0.0;
      if (r % 23 == 0) energy[i] = HUGE_VAL;
      if (r % 29 == 0) energy[i] = 1e300;
    }
    EXPECT_EQ(ByEnergyDescending(energy), Reference(energy)) << m;
  }
}

TEST(ByEnergyDescendingTest, AllEqualKeepsIndexOrder) {
  const std::vector<double> energy(1000, 2.5);
  std::vector<uint32_t> want(1000);
  std::iota(want.begin(), want.end(), 0u);
  EXPECT_EQ(ByEnergyDescending(energy), want);
}

}  // namespace
}  // namespace dynamiq::kernels
