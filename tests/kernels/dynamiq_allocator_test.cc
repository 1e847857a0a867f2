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

// Relative error per width of the shape the codec measures (about 4x less per extra bit).
WidthErrors TestErrors() {
  WidthErrors e{};
  for (int w = 2; w <= 8; ++w) e[w] = 0.3 * std::pow(0.26, w - 2);
  return e;
}

// Log-normal energies: `m` super-groups around `scale`.
std::vector<double> Energies(size_t m, double scale, uint32_t seed) {
  std::vector<double> e(m);
  for (size_t j = 0; j < m; ++j) {
    const float u = BitsToUnit(RandomBits(StreamKey(seed, 1, 2), static_cast<uint32_t>(j)));
    e[j] = scale * std::exp(3.0 * (u - 0.5));
  }
  return e;
}

// Expected error sum_j F_j err(w_j) of bucket-wise allocations at the given budgets.
double ExpectedError(const std::vector<std::vector<double>>& energies, const std::vector<size_t>& sizes,
                     const std::vector<double>& budgets, const WidthErrors& errors) {
  double total = 0;
  for (size_t k = 0; k < energies.size(); ++k) {
    const Allocation a = AllocateWidths(energies[k], sizes[k], budgets[k], BitAllocator::kMeasured, errors);
    for (size_t j = 0; j < energies[k].size(); ++j) total += energies[k][j] * errors[a.widths[j]];
  }
  return total;
}

TEST(StepBudgetsTest, EqualBucketsShareEqually) {
  const std::vector<double> e = Energies(400, 1.0, 3);
  const std::vector<std::vector<double>> energies = {e, e};
  const std::vector<size_t> sizes = {400 * 256, 400 * 256};
  const std::vector<double> b = StepBudgets(energies, sizes, 5.0, 3.0, 8.0, BitAllocator::kMeasured, TestErrors());
  ASSERT_EQ(b.size(), 2u);
  // Equal up to the leftover upgrades, which go to the tied super-groups in index order: at most
  // one width step of one super-group each way.
  EXPECT_NEAR(b[0], b[1], 2.0 * 256 / (400 * 256));
  EXPECT_LE(0.5 * (b[0] + b[1]), 5.0);
  EXPECT_GT(b[0], 4.9);
  EXPECT_GT(b[1], 4.9);
}

TEST(StepBudgetsTest, EnergeticBucketGetsMoreAndTheStepKeepsItsBudget) {
  const WidthErrors errors = TestErrors();
  // A small bucket with 30x the energy per super-group of a large one (a CNN's conv weights next to
  // its dense layers).
  const std::vector<std::vector<double>> energies = {Energies(1000, 1.0, 4), Energies(80, 30.0, 5)};
  const std::vector<size_t> sizes = {1000 * 256, 80 * 256 - 100};
  const std::vector<double> b = StepBudgets(energies, sizes, 5.0, 3.0, 8.0, BitAllocator::kMeasured, errors);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_LT(b[0], 5.0);
  EXPECT_GT(b[1], 6.5);
  EXPECT_LE(b[1], 8.0);
  const double average = (b[0] * sizes[0] + b[1] * sizes[1]) / static_cast<double>(sizes[0] + sizes[1]);
  EXPECT_LE(average, 5.0 + 1e-12);
  EXPECT_GT(average, 4.95);
  // The point: less expected error than 5 bits on each bucket, at the same bits.
  EXPECT_LT(ExpectedError(energies, sizes, b, errors), 0.7 * ExpectedError(energies, sizes, {5.0, 5.0}, errors));
}

TEST(StepBudgetsTest, SharesAreTheJointAllocationsBits) {
  const WidthErrors errors = TestErrors();
  const std::vector<std::vector<double>> energies = {Energies(300, 1.0, 6), Energies(200, 4.0, 7),
                                                     Energies(100, 0.5, 8)};
  const std::vector<size_t> sizes = {300 * 256, 200 * 256, 100 * 256};
  const std::vector<double> b = StepBudgets(energies, sizes, 4.5, 3.0, 8.0, BitAllocator::kMeasured, errors);
  std::vector<double> joint;
  for (const auto& e : energies) joint.insert(joint.end(), e.begin(), e.end());
  const Allocation a = AllocateWidths(joint, 600 * 256, 4.5, BitAllocator::kMeasured, errors);
  size_t pos = 0;
  for (size_t k = 0; k < 3; ++k) {
    double bits = 0;
    for (size_t j = 0; j < energies[k].size(); ++j) {
      bits += kFixedBitsPerSuperGroup + SuperGroupPayloadBits(a.widths[pos++]);
    }
    EXPECT_DOUBLE_EQ(b[k], bits / static_cast<double>(sizes[k])) << k;
  }
}

TEST(StepBudgetsTest, ClampsToTheCodecRangeAndResplitsTheRest) {
  const WidthErrors errors = TestErrors();
  // Bucket 0 is all zeros (0.14 bits/coord of statistics and width map would do), bucket 1 holds all
  // the energy (it would take more than 8 bits), bucket 2 is ordinary.
  const std::vector<std::vector<double>> energies = {std::vector<double>(100, 0.0), Energies(100, 1e6, 9),
                                                     Energies(400, 1.0, 10)};
  const std::vector<size_t> sizes = {100 * 256, 100 * 256, 400 * 256};
  const std::vector<double> b = StepBudgets(energies, sizes, 5.0, 3.0, 8.0, BitAllocator::kMeasured, errors);
  EXPECT_EQ(b[0], 3.0);
  EXPECT_EQ(b[1], 8.0);
  // Bucket 2 gets what is left: 5 x 600 - 3 x 100 - 8 x 100 = 1900 per 256 elements over 400.
  EXPECT_LE(b[2], 1900.0 / 400.0 + 1e-12);
  EXPECT_GT(b[2], 1900.0 / 400.0 - 0.05);
}

TEST(StepBudgetsTest, OneBucketKeepsItsBudget) {
  const std::vector<std::vector<double>> energies = {Energies(500, 1.0, 11)};
  const std::vector<size_t> sizes = {500 * 256};
  const std::vector<double> b = StepBudgets(energies, sizes, 5.0, 3.0, 8.0, BitAllocator::kMeasured, TestErrors());
  EXPECT_LE(b[0], 5.0);
  EXPECT_GT(b[0], 4.95);
}

TEST(EnergiesFromStatsTest, SquaredNormsAndInfinityForNonFinite) {
  const std::vector<float> stats = {0.5f, 2.0f, -1.0f, 0.0f, 0.0f, NAN, 1.0f, INFINITY};
  const std::vector<double> e = EnergiesFromStats(stats);
  ASSERT_EQ(e.size(), 4u);
  EXPECT_EQ(e[0], 4.0);
  EXPECT_EQ(e[1], 0.0);
  EXPECT_EQ(e[2], HUGE_VAL);
  EXPECT_EQ(e[3], HUGE_VAL);
}

}  // namespace
}  // namespace dynamiq::kernels
