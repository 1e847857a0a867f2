#include "tools/linkem/link_settings.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tools/linkem/loss_model.h"

namespace dynamiq::linkem {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(LinkSettingsTest, ParsesLossModels) {
  auto bernoulli = ParseLoss("0.001");
  ASSERT_THAT(bernoulli, IsOk());
  EXPECT_DOUBLE_EQ(bernoulli->MeanLoss(), 0.001);
  auto ge = ParseLoss("ge:0.001,0.1");
  ASSERT_THAT(ge, IsOk());
  EXPECT_NEAR(ge->MeanLoss(), 0.001 / 0.101, 1e-12);
  auto partial = ParseLoss("ge:0.01,0.5,0.5,0.001");
  ASSERT_THAT(partial, IsOk());
  EXPECT_NEAR(partial->MeanLoss(), (0.01 * 0.5 + 0.5 * 0.001) / 0.51, 1e-12);
  EXPECT_TRUE(ParseLoss("0")->none());
}

TEST(LinkSettingsTest, RefusesImpossibleSettingsNamingThem) {
  EXPECT_THAT(ParseLoss("1.5"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--loss: '1.5'")));
  EXPECT_THAT(ParseLoss("-0.1"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseLoss("nan"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseLoss("ge:0.1"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ge:P_GB,P_BG")));
  EXPECT_THAT(ParseLoss("ge:0.1,0"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("never leaves")));
  EXPECT_THAT(ParseDelay("-5ms", "--rtt"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--rtt: -5ms is negative")));
  EXPECT_THAT(ParseDelay("11s", "--rtt"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseDelay("soon", "--rtt"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a duration")));
  EXPECT_EQ(*ParseDelay("0", "--rtt"), absl::ZeroDuration());
  EXPECT_EQ(*ParseDelay("37.5ms", "--rtt"), absl::Microseconds(37500));
  EXPECT_THAT(FindProfile("moon"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cross-continent")));
}

TEST(LinkSettingsTest, ProfilesAreValid) {
  for (const Profile& p : Profiles()) {
    EXPECT_THAT(ParseLoss(p.loss), IsOk()) << p.name;
    EXPECT_GE(p.rtt, absl::ZeroDuration()) << p.name;
  }
  EXPECT_EQ(FindProfile("cross-continent")->rtt, absl::Milliseconds(150));
}

// The filter's own math (loss_model.h runs in the kernel as it runs here): the fraction lost and
// the mean burst length over 10^6 packets, within 5 sigma of the chain's.
TEST(LossModelTest, BernoulliAndGilbertElliottLoseWhatTheySay) {
  constexpr int kPackets = 1000000;
  struct Case {
    const char* spec;
    double burst;  // mean length of a run of losses
  };
  for (const Case& c : {Case{"0.01", 1 / 0.99}, Case{"ge:0.001,0.1", 10.0}, Case{"0.5", 2.0}}) {
    SCOPED_TRACE(c.spec);
    const LossModel m = *ParseLoss(c.spec);
    const dq_loss_config config = m.ToConfig();
    dq_loss_state state{dq_loss_seed(7, 0), 0, 0};
    int lost = 0, bursts = 0;
    bool previous = false;
    for (int i = 0; i < kPackets; ++i) {
      const bool now = dq_loss_step(&config, &state) != 0;
      lost += now;
      bursts += now && !previous;
      previous = now;
    }
    const double p = m.MeanLoss();
    // Bursts make the count's variance larger than the binomial's by about (2 * burst - 1).
    const double sigma = std::sqrt(kPackets * p * (1 - p) * (2 * c.burst - 1));
    EXPECT_NEAR(lost, kPackets * p, 5 * sigma);
    EXPECT_NEAR(static_cast<double>(lost) / bursts, c.burst, 0.05 * c.burst);
  }
}

TEST(LossModelTest, NoLossAndCertainLoss) {
  dq_loss_state state{dq_loss_seed(1, 0), 0, 0};
  const dq_loss_config none = LossModel::Bernoulli(0).ToConfig(), all = LossModel::Bernoulli(1).ToConfig();
  for (int i = 0; i < 10000; ++i) {
    EXPECT_FALSE(dq_loss_step(&none, &state));
    EXPECT_TRUE(dq_loss_step(&all, &state));
  }
  EXPECT_NE(dq_loss_seed(0, 0), 0u);
  EXPECT_NE(dq_loss_seed(1, 0), dq_loss_seed(1, 1));
}

}  // namespace
}  // namespace dynamiq::linkem
