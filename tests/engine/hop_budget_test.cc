#include "engine/hop_budget.h"

#include <cmath>
#include <vector>

#include "engine/schedule.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::testing::ElementsAre;

Schedule Make(Topology t, int n) {
  auto s = MakeSchedule(t, n);
  EXPECT_THAT(s, IsOk());
  return *s;
}

double MeanCost(const HopMessages& h, const std::vector<double>& bits) {
  double cost = 0, messages = 0;
  for (size_t k = 0; k < bits.size(); ++k) {
    if (h.compressions[k] == 0) continue;
    cost += h.messages[k] * bits[k];
    messages += h.messages[k];
  }
  return cost / messages;
}

TEST(HopBudgetTest, RingCompressesEverySummandCountOncePerChunkAndForwardsTheFinalSum) {
  const HopMessages h = CountHopMessages(Make(Topology::kRing, 8));
  EXPECT_THAT(h.compressions, ElementsAre(8, 8, 8, 8, 8, 8, 8, 8));
  EXPECT_THAT(h.messages, ElementsAre(8, 8, 8, 8, 8, 8, 8, 56));
}

TEST(HopBudgetTest, ButterflyCompressesPowersOfTwo) {
  const HopMessages h = CountHopMessages(Make(Topology::kButterfly, 8));
  EXPECT_THAT(h.compressions, ElementsAre(32, 16, 0, 8, 0, 0, 0, 8));
  EXPECT_THAT(h.messages, ElementsAre(32, 16, 0, 8, 0, 0, 0, 56));
}

TEST(HopBudgetTest, OneRankIsOneMessage) {
  const HopMessages h = CountHopMessages(Make(Topology::kRing, 1));
  EXPECT_THAT(h.compressions, ElementsAre(1));
  EXPECT_THAT(h.messages, ElementsAre(1));
}

TEST(HopBudgetTest, EnergiesOfAgreeingRanksGrowLikeTheSquareOfTheSummands) {
  for (Topology t : {Topology::kRing, Topology::kButterfly}) {
    const int n = 4;
    const size_t d = n * 256;
    const std::vector<std::vector<float>> ones(n, std::vector<float>(d, 1.0f));
    const std::vector<double> e = HopEnergies(Make(t, n), d, ones, {});
    ASSERT_EQ(e.size(), 4u);
    EXPECT_DOUBLE_EQ(e[0], 256.0);
    EXPECT_DOUBLE_EQ(e[1], 4 * 256.0);
    EXPECT_DOUBLE_EQ(e[2], t == Topology::kRing ? 9 * 256.0 : 0.0);  // the butterfly never sends 3 summands
    EXPECT_DOUBLE_EQ(e[3], 16 * 256.0);
    // Centring on the value itself leaves nothing.
    const std::vector<float> subtract(d / 256, 1.0f);
    EXPECT_DOUBLE_EQ(HopEnergies(Make(t, n), d, ones, subtract)[3], 0.0);
  }
}

TEST(HopBudgetTest, CorrelationOfAgreeingAndOfOrthogonalRanks) {
  const size_t d = 512;
  std::vector<std::vector<float>> x(2, std::vector<float>(d, 1.0f));
  EXPECT_DOUBLE_EQ(RankCorrelation(d, x, {}), 1.0);
  for (size_t i = 1; i < d; i += 2) x[1][i] = -1.0f;
  EXPECT_DOUBLE_EQ(RankCorrelation(d, x, {}), 0.0);
  EXPECT_THAT(HopEnergyModel(3, 0.5), ElementsAre(1.0, 3.0, 6.0));
}

TEST(HopBudgetTest, LagrangeRuleOnUncorrelatedRingRanks) {
  const HopMessages h = CountHopMessages(Make(Topology::kRing, 8));
  const std::vector<double> b = HopBudgets(h, HopEnergyModel(8, 0.0), 5.0, 3.0, 8.0);
  ASSERT_EQ(b.size(), 8u);
  EXPECT_NEAR(MeanCost(h, b), 5.0, 1e-9);
  for (int k = 2; k <= 7; ++k) EXPECT_NEAR(b[k - 1] - b[0], 0.5 * std::log2(k), 1e-9);
  // The final sum is paid 7 times: half a bit of log2(8 / 7) above the first hop.
  EXPECT_NEAR(b[7] - b[0], 0.5 * std::log2(8.0 / 7.0), 1e-9);
  for (double v : HopBudgets(h, HopEnergyModel(8, 0.0), 5.0, 3.0, 8.0, /*tilt=*/0)) EXPECT_NEAR(v, 5.0, 1e-9);
}

TEST(HopBudgetTest, ClampsKeepTheCost) {
  const HopMessages h = CountHopMessages(Make(Topology::kRing, 8));
  const std::vector<double> b = HopBudgets(h, HopEnergyModel(8, 1.0), 3.5, 3.0, 8.0);  // E_k = k^2
  EXPECT_NEAR(MeanCost(h, b), 3.5, 1e-9);
  EXPECT_DOUBLE_EQ(b[0], 3.0);
  for (size_t k = 1; k < b.size(); ++k) EXPECT_GE(b[k], b[0]);
  for (double v : HopBudgets(h, HopEnergyModel(8, 1.0), 2.0, 3.0, 8.0)) EXPECT_DOUBLE_EQ(v, 3.0);
  for (double v : HopBudgets(h, HopEnergyModel(8, 1.0), 9.0, 3.0, 8.0)) EXPECT_DOUBLE_EQ(v, 8.0);
  // A k without energy gets the floor; one never compressed keeps the mean.
  std::vector<double> e = HopEnergyModel(8, 0.0);
  e[1] = 0;
  EXPECT_DOUBLE_EQ(HopBudgets(h, e, 5.0, 3.0, 8.0)[1], 3.0);
  const HopMessages bf = CountHopMessages(Make(Topology::kButterfly, 8));
  const std::vector<double> bb = HopBudgets(bf, HopEnergyModel(8, 0.0), 5.0, 3.0, 8.0);
  EXPECT_DOUBLE_EQ(bb[2], 5.0);
  EXPECT_NEAR(MeanCost(bf, bb), 5.0, 1e-9);
}

}  // namespace
}  // namespace dynamiq::engine
