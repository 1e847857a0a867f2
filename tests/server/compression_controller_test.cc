#include "server/compression_controller.h"

#include <cmath>
#include <deque>
#include <limits>
#include <memory>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr double kTarget = 1e-3;

std::unique_ptr<CompressionController> MakeController(ErrorBudgetPolicy policy = {kTarget, 3, 8},
                                                      ControllerTuning tuning = {}) {
  auto c = CompressionController::Create(policy, tuning);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

bool OnGrid(double bits, double quantum = 0.25) { return std::abs(bits / quantum - std::round(bits / quantum)) < 1e-9; }

// A job in closed loop with the controller: the error it measures at b̄ is
//   level x factor^-(b - 5) x noise,
// and a decision takes effect `delay` samples after the one it was made on (dynamiqd: two
// collectives), under a new epoch; samples in between still carry the old epoch.
class Plant {
 public:
  Plant(CompressionController* c, double bits, double level, double factor, double noise_sigma, int delay = 2)
      : c_(c), bits_(bits), level_(level), factor_(factor), noise_(noise_sigma), delay_(delay) {}

  void set_level(double level) { level_ = level; }
  double level() const { return level_; }
  double bits() const { return bits_; }
  int decisions() const { return decisions_; }
  int reversals() const { return reversals_; }

  // One sample; returns the error measured at it.
  double Step() {
    if (!scheduled_.empty() && scheduled_.front().at <= samples_) {
      bits_ = scheduled_.front().bits;
      epoch_ = scheduled_.front().epoch;
      scheduled_.pop_front();
    }
    const double noise = noise_ > 0 ? std::exp(noise_ * normal_(rng_)) : 1.0;
    const double v = Error(bits_) * noise;
    std::optional<BitsDecision> d = c_->Observe({v, bits_, epoch_});
    ++samples_;
    if (d.has_value()) {
      EXPECT_EQ(d->based_on_epoch, epoch_);
      EXPECT_DOUBLE_EQ(d->from_bits, bits_);
      EXPECT_TRUE(OnGrid(d->bits)) << d->bits;
      ++decisions_;
      const int direction = d->bits > bits_ ? 1 : -1;
      if (last_direction_ != 0 && direction != last_direction_) ++reversals_;
      last_direction_ = direction;
      c_->Published(++latest_epoch_);
      scheduled_.push_back({samples_ + delay_, d->bits, latest_epoch_});
    }
    return v;
  }

  double Error(double bits) const { return level_ * std::pow(factor_, 5 - bits); }

 private:
  struct Change {
    int at;
    double bits;
    uint64_t epoch;
  };
  CompressionController* c_;
  double bits_;
  double level_, factor_, noise_;
  int delay_;
  uint64_t epoch_ = 0, latest_epoch_ = 0;
  int samples_ = 0, decisions_ = 0, reversals_ = 0, last_direction_ = 0;
  std::deque<Change> scheduled_;
  std::mt19937 rng_{12345};
  std::normal_distribution<double> normal_;
};

TEST(CompressionControllerTest, RejectsBadPolicies) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const ErrorBudgetPolicy& p : {ErrorBudgetPolicy{0, 3, 8}, ErrorBudgetPolicy{-1e-3, 3, 8},
                                     ErrorBudgetPolicy{1, 3, 8}, ErrorBudgetPolicy{nan, 3, 8}}) {
    EXPECT_THAT(CompressionController::Create(p),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_vnmse")))
        << p.target_vnmse;
  }
  EXPECT_THAT(CompressionController::Create({kTarget, 2, 8}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("min_bits")));
  EXPECT_THAT(CompressionController::Create({kTarget, 3, 9}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_bits")));
  EXPECT_THAT(CompressionController::Create({kTarget, nan, 8}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("min_bits")));
  EXPECT_THAT(CompressionController::Create({kTarget, 6, 5}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must not exceed")));
  EXPECT_THAT(ValidateErrorBudgetPolicy({kTarget, 4.5, 4.5}), ::dynamiq::testing::IsOk());
}

TEST(CompressionControllerTest, RejectsBadTuning) {
  auto bad = [](auto edit, const char* what) {
    ControllerTuning t;
    edit(t);
    EXPECT_THAT(CompressionController::Create({kTarget, 3, 8}, t),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
  };
  bad([](ControllerTuning& t) { t.per_bit_factor = 1; }, "per_bit_factor");
  bad([](ControllerTuning& t) { t.per_bit_factor = std::numeric_limits<double>::infinity(); }, "per_bit_factor");
  bad([](ControllerTuning& t) { t.quantum_bits = 0; }, "quantum_bits");
  bad([](ControllerTuning& t) { t.aim = 0; }, "aim");
  bad([](ControllerTuning& t) { t.aim = 1.5; }, "aim");
  bad([](ControllerTuning& t) { t.spike_factor = 0.5; }, "spike_factor");
  bad([](ControllerTuning& t) { t.raise_votes = 4; }, "raise_votes");
  bad([](ControllerTuning& t) { t.lower_below = 0; }, "lower_below");
  bad([](ControllerTuning& t) { t.lower_after = 0; }, "lower_after");
  bad([](ControllerTuning& t) { t.max_cooldown = 1; }, "max_cooldown");
  bad([](ControllerTuning& t) { t.max_lower_step = 0.1; }, "max_lower_step");
}

TEST(CompressionControllerTest, RaisesAtOnceOnASpikeToTheModelsBudget) {
  auto c = MakeController();
  const std::optional<BitsDecision> d = c->Observe({3 * kTarget, 5.0, 7});
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->kind, BitsDecision::Kind::kRaise);
  EXPECT_EQ(d->based_on_epoch, 7u);
  EXPECT_DOUBLE_EQ(d->from_bits, 5.0);
  // 5 + log(3 / 0.7) / log(6) = 5.81 -> the next quarter bit.
  EXPECT_DOUBLE_EQ(d->bits, 6.0);
  EXPECT_LE(d->predicted_vnmse, 0.7 * kTarget);
  EXPECT_GT(c->Predict(3 * kTarget, 5.0, 5.75), 0.7 * kTarget);  // and not less would do
  EXPECT_THAT(d->reason, HasSubstr("raise 5.00 -> 6.00"));
  EXPECT_EQ(BitsDecisionKindName(d->kind), "raise");
}

TEST(CompressionControllerTest, RaisesOnTheSecondSampleAboveTargetButNotOnOne) {
  auto c = MakeController();
  EXPECT_FALSE(c->Observe({1.5 * kTarget, 5.0, 0}).has_value());  // above, but not a spike
  EXPECT_FALSE(c->Observe({0.6 * kTarget, 5.0, 0}).has_value());
  EXPECT_FALSE(c->Observe({0.6 * kTarget, 5.0, 0}).has_value());
  EXPECT_FALSE(c->Observe({1.5 * kTarget, 5.0, 0}).has_value());              // 1 of the last 3
  const std::optional<BitsDecision> d = c->Observe({1.2 * kTarget, 5.0, 0});  // 2 of the last 3
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->kind, BitsDecision::Kind::kRaise);
  // From the window's largest sample: 1.5 / 0.7 needs log6(2.14) = 0.43 bits -> 5.5.
  EXPECT_DOUBLE_EQ(d->bits, 5.5);
  EXPECT_THAT(d->reason, HasSubstr("2 of the last 3"));
}

TEST(CompressionControllerTest, IgnoresSamplesOfEpochsBeforeTheDecision) {
  auto c = MakeController();
  ASSERT_TRUE(c->Observe({5 * kTarget, 5.0, 3}).has_value());
  // Not yet published: the collectives before the switch keep reporting the old budget.
  EXPECT_FALSE(c->Observe({5 * kTarget, 5.0, 3}).has_value());
  EXPECT_TRUE(c->stats().decision_pending);
  c->Published(4);
  EXPECT_FALSE(c->stats().decision_pending);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(c->Observe({5 * kTarget, 5.0, 3}).has_value());
  EXPECT_FALSE(c->Observe({9 * kTarget, 5.0, 2}).has_value());  // older still
  CompressionController::Stats s = c->stats();
  EXPECT_EQ(s.samples_stale, 7u);
  EXPECT_EQ(s.samples_used, 1u);
  EXPECT_EQ(s.raises, 1u);
  // The new budget's samples count.
  EXPECT_FALSE(c->Observe({0.3 * kTarget, 6.5, 4}).has_value());
  s = c->stats();
  EXPECT_EQ(s.epoch, 4u);
  EXPECT_DOUBLE_EQ(s.bits, 6.5);
  EXPECT_EQ(s.samples_used, 2u);
}

TEST(CompressionControllerTest, ARejectedDecisionIsDecidedAgain) {
  auto c = MakeController();
  ASSERT_TRUE(c->Observe({5 * kTarget, 5.0, 1}).has_value());
  c->Rejected();  // e.g. an operator changed the configuration meanwhile
  EXPECT_EQ(c->stats().rejected, 1u);
  EXPECT_EQ(c->stats().raises, 0u);
  const std::optional<BitsDecision> again = c->Observe({5 * kTarget, 5.0, 1});
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->kind, BitsDecision::Kind::kRaise);
}

TEST(CompressionControllerTest, AdoptsABudgetSomeoneElseSet) {
  auto c = MakeController();
  EXPECT_FALSE(c->Observe({0.6 * kTarget, 5.0, 1}).has_value());
  // An operator's change (epoch 2) arrives without any decision of ours.
  EXPECT_FALSE(c->Observe({0.2 * kTarget, 7.0, 2}).has_value());
  EXPECT_DOUBLE_EQ(c->stats().bits, 7.0);
  EXPECT_EQ(c->stats().epoch, 2u);
}

TEST(CompressionControllerTest, LowersOnlyAfterKConsecutiveSamplesWellBelowTarget) {
  ControllerTuning t;
  auto c = MakeController({kTarget, 3, 8}, t);
  for (int i = 0; i < t.lower_after - 1; ++i) EXPECT_FALSE(c->Observe({0.1 * kTarget, 6.0, 0}).has_value()) << i;
  // One sample that is not well below restarts the count.
  EXPECT_FALSE(c->Observe({0.6 * kTarget, 6.0, 0}).has_value());
  for (int i = 0; i < t.lower_after - 1; ++i) EXPECT_FALSE(c->Observe({0.1 * kTarget, 6.0, 0}).has_value()) << i;
  const std::optional<BitsDecision> d = c->Observe({0.1 * kTarget, 6.0, 0});
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->kind, BitsDecision::Kind::kLower);
  EXPECT_LT(d->bits, 6.0);
  EXPECT_GE(d->bits, 6.0 - t.max_lower_step);
  EXPECT_LE(d->predicted_vnmse, t.aim * kTarget);
  EXPECT_THAT(d->reason, HasSubstr("lower 6.00 -> "));
}

TEST(CompressionControllerTest, LowersAtMostMaxLowerStepAtATime) {
  auto c = MakeController();
  std::optional<BitsDecision> d;
  for (int i = 0; i < 6 && !d.has_value(); ++i) d = c->Observe({0.1 * kTarget, 6.0, 0});
  ASSERT_TRUE(d.has_value());
  // log6(0.7 / 0.1) = 1.09 bits would do, but a lowering moves at most max_lower_step (1).
  EXPECT_DOUBLE_EQ(d->bits, 5.0);
  EXPECT_THAT(d->reason, HasSubstr("lower 6.00 -> 5.00"));
}

// The lowering predicts from a high quantile of the budget's samples, exp(mean + 2 sd) of their
// logarithms: noisier samples, smaller steps down.
TEST(CompressionControllerTest, LowersLessWhenTheSamplesAreNoisy) {
  auto steady = MakeController();
  auto noisy = MakeController();
  std::optional<BitsDecision> a, b;
  for (int i = 0; i < 12; ++i) {
    if (!a.has_value()) a = steady->Observe({0.028 * kTarget, 6.0, 0});
    if (!b.has_value()) b = noisy->Observe({(i % 2 == 0 ? 0.02 : 0.04) * kTarget, 6.0, 0});  // same log-mean
  }
  ASSERT_TRUE(a.has_value());
  ASSERT_TRUE(b.has_value());
  EXPECT_NEAR(noisy->stats().noise_sigma, std::log(2.0) / 0.954, 1e-9);
  EXPECT_EQ(steady->stats().noise_sigma, 0);
  EXPECT_DOUBLE_EQ(a->bits, 5.0);  // max_lower_step
  EXPECT_DOUBLE_EQ(b->bits, 5.5);  // 0.028 x e^(3 x 0.73) = 0.25: log6(0.7 / 0.25) = 0.57 bits
}

TEST(CompressionControllerTest, LowersOnlyAsFarAsTheModelKeepsTheErrorUnderTheAim) {
  auto c = MakeController();
  std::optional<BitsDecision> d;
  for (int i = 0; i < 6 && !d.has_value(); ++i) d = c->Observe({(i == 2 ? 0.3 : 0.2) * kTarget, 6.0, 0});
  ASSERT_TRUE(d.has_value());
  // From the largest of the run (0.3): 0.3 x 6^0.25 = 0.47 <= 0.7, 0.3 x 6^0.5 = 0.73 > 0.7.
  EXPECT_DOUBLE_EQ(d->bits, 5.75);
  // Samples under lower_below but too close for even a quantum less: no lowering.
  auto close = MakeController();
  for (int i = 0; i < 50; ++i) EXPECT_FALSE(close->Observe({0.48 * kTarget, 6.0, 0}).has_value()) << i;
}

TEST(CompressionControllerTest, WaitsForTheCooldownAfterARaise) {
  ControllerTuning t;
  auto c = MakeController({kTarget, 3, 8}, t);
  ASSERT_TRUE(c->Observe({5 * kTarget, 5.0, 0}).has_value());
  c->Published(1);
  int samples = 0;
  std::optional<BitsDecision> d;
  while (!d.has_value() && samples < 100) {
    d = c->Observe({0.05 * kTarget, 6.0, 1});
    ++samples;
  }
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->kind, BitsDecision::Kind::kLower);
  EXPECT_EQ(samples, t.raise_cooldown);  // not after lower_after (6): the cooldown is 12
}

TEST(CompressionControllerTest, ClampsToThePolicyRange) {
  // A budget outside [min, max] (the job's budget when the policy was set) is clamped at once.
  auto c = MakeController({kTarget, 4, 6});
  std::optional<BitsDecision> d = c->Observe({1e-5, 8.0, 0});
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->kind, BitsDecision::Kind::kClamp);
  EXPECT_DOUBLE_EQ(d->bits, 6.0);
  c->Published(1);
  EXPECT_EQ(c->stats().clamps, 1u);
  // Never above max_bits, however large the error: saturated instead.
  d = c->Observe({0.5, 6.0, 1});
  EXPECT_FALSE(d.has_value());
  EXPECT_TRUE(c->stats().saturated);
  // Never below min_bits, however small.
  auto low = MakeController({kTarget, 4, 6});
  for (int i = 0; i < 30; ++i) {
    d = low->Observe({1e-9, 4.0, 0});
    EXPECT_FALSE(d.has_value()) << i;
  }
  // A raise that the model says cannot meet the target goes to max_bits and says so.
  auto far = MakeController({kTarget, 3, 6});
  d = far->Observe({100 * kTarget, 5.0, 0});
  ASSERT_TRUE(d.has_value());
  EXPECT_DOUBLE_EQ(d->bits, 6.0);
  EXPECT_THAT(d->reason, HasSubstr("unreachable"));
  // A lowering never goes under min_bits either.
  auto floor = MakeController({kTarget, 5.5, 8});
  d.reset();
  for (int i = 0; i < 6 && !d.has_value(); ++i) d = floor->Observe({1e-7, 6.0, 0});
  ASSERT_TRUE(d.has_value());
  EXPECT_DOUBLE_EQ(d->bits, 5.5);
}

TEST(CompressionControllerTest, IgnoresSamplesThatAreNotDynamiqErrors) {
  auto c = MakeController();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(c->Observe({nan, 5.0, 0}).has_value());
  EXPECT_FALSE(c->Observe({-1, 5.0, 0}).has_value());
  EXPECT_FALSE(c->Observe({1.0, 0.0, 0}).has_value());   // an uncompressed tensor
  EXPECT_FALSE(c->Observe({1.0, 16.0, 0}).has_value());  // not a DynamiQ budget
  EXPECT_FALSE(c->Observe({0.5 * kTarget, 5.0, 0}).has_value());
  EXPECT_FALSE(c->Observe({1.0, 5.5, 0}).has_value());  // another budget in the same epoch
  CompressionController::Stats s = c->stats();
  EXPECT_EQ(s.samples_invalid, 5u);
  EXPECT_EQ(s.samples_used, 1u);
}

TEST(CompressionControllerTest, InitialBits) {
  const ErrorBudgetPolicy p{kTarget, 4, 6};
  EXPECT_DOUBLE_EQ(CompressionController::InitialBits(p, 5.25), 5.25);
  EXPECT_DOUBLE_EQ(CompressionController::InitialBits(p, 8.0), 6.0);
  EXPECT_DOUBLE_EQ(CompressionController::InitialBits(p, std::nullopt), 5.0);
  EXPECT_DOUBLE_EQ(CompressionController::InitialBits(p, std::nullopt, 3.0), 4.0);
}

// Stationary, noisy errors (each sample x e^(0.4 z): a sample is 1.5x off one time in three), and a
// plant whose true slope is not the model's. After settling, the controller holds still: a few
// decisions at most, no raise/lower back-and-forth, and the error stays under target.
TEST(CompressionControllerTest, DoesNotOscillateOnNoisyStationaryInput) {
  for (double true_factor : {3.0, 6.0, 12.0}) {
    SCOPED_TRACE(true_factor);
    auto c = MakeController();
    Plant plant(c.get(), 5.0, 0.2 * kTarget, true_factor, 0.4);  // 5 bits is well below the target
    for (int i = 0; i < 300; ++i) plant.Step();                  // settle
    const int decisions_before = plant.decisions(), reversals_before = plant.reversals();
    int above = 0;
    const int n = 2000;
    for (int i = 0; i < n; ++i) above += plant.Step() > kTarget;
    EXPECT_LE(plant.decisions() - decisions_before, 6);
    EXPECT_LE(plant.reversals() - reversals_before, 3);
    EXPECT_LE(above, n / 100) << "bits " << plant.bits();
    // And it does not sit far above the need: half a bit less would have a median error above
    // aim x target / e^(2 sigma), the margin its high-quantile rule for lowering keeps.
    EXPECT_GT(plant.Error(plant.bits() - 0.5), 0.7 * kTarget / std::exp(2 * 0.4)) << plant.bits();
  }
}

// The guarantee: when the error jumps above the target, it is decided on the first sample (above
// 2x target) or the second, and the error is under target again once the switch applies.
TEST(CompressionControllerTest, ReactsWithinTheStatedNumberOfSamples) {
  for (double jump : {1.6, 4.0, 20.0}) {
    SCOPED_TRACE(jump);
    auto c = MakeController();
    Plant plant(c.get(), 5.0, 0.3 * kTarget, 6.0, 0.0);
    for (int i = 0; i < 50; ++i) plant.Step();
    const double settled = plant.bits();
    // From now on the error at the settled budget is jump x target.
    plant.set_level(plant.level() * jump * kTarget / plant.Error(settled));
    int over = 0, last_over = -1;
    for (int i = 0; i < 40; ++i) {
      if (plant.Step() > kTarget) {
        ++over;
        last_over = i;
      }
    }
    const int decide = jump > 2 ? 1 : 2;  // samples until the decision
    // The samples up to the decision and the two that still run the old budget.
    EXPECT_LE(last_over, decide - 1 + 2) << "over target " << over << " samples";
    EXPECT_GT(plant.bits(), settled);
  }
}

// A lowering that the job cannot afford (a cliff the model does not know) is undone by a raise;
// each undone lowering doubles the wait before the next try, so the attempts thin out.
TEST(CompressionControllerTest, BacksOffLoweringsThatGetUndone) {
  ControllerTuning t;
  auto c = MakeController({kTarget, 3, 8}, t);
  uint64_t epoch = 0;
  double bits = 6.0;
  int undone = 0, undone_early = 0;
  const int n = 1500;
  for (int i = 0; i < n; ++i) {
    const double v = bits >= 6.0 ? 0.2 * kTarget : 5 * kTarget;  // a cliff under 6 bits
    std::optional<BitsDecision> d = c->Observe({v, bits, epoch});
    if (!d.has_value()) continue;
    if (d->kind == BitsDecision::Kind::kRaise) {
      ++undone;
      if (i < 300) ++undone_early;
    }
    c->Published(++epoch);
    bits = d->bits;  // applies at once here
  }
  // Without backoff a lowering would fail every ~cooldown + lower_after = 18 samples (~80 times).
  // With it, the wait doubles to max_cooldown (96) after three failures.
  EXPECT_EQ(c->stats().cooldown, t.max_cooldown);
  EXPECT_LE(undone, n / t.max_cooldown + 4);
  EXPECT_GE(undone, 3);
  EXPECT_LE(undone_early, 5);
}

// Once the job's statistics change so that a budget that failed holds, the backoff relaxes.
TEST(CompressionControllerTest, TheBackoffRelaxesWhenTheFailedBudgetHolds) {
  ControllerTuning t;
  auto c = MakeController({kTarget, 3, 8}, t);
  uint64_t epoch = 0;
  double bits = 6.0;
  bool cliff = true;
  for (int i = 0; i < 1500; ++i) {
    if (i == 600) cliff = false;
    const double v = (bits >= 6.0 || !cliff) ? 0.2 * kTarget : 5 * kTarget;
    std::optional<BitsDecision> d = c->Observe({v, bits, epoch});
    if (i == 599) {
      EXPECT_GT(c->stats().cooldown, t.raise_cooldown);
    }
    if (!d.has_value()) continue;
    c->Published(++epoch);
    bits = d->bits;
  }
  EXPECT_EQ(c->stats().cooldown, t.raise_cooldown);
  EXPECT_LT(bits, 5.5);
}

}  // namespace
}  // namespace dynamiq::server
