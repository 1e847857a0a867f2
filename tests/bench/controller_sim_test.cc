// Evidence for error-budget compression (issue 8): the controller in closed loop with the real
// DynamiQ codec on the simulated 8-rank ring all-reduce, one all-reduce per training step, while
// the gradient distribution shifts mid-run and back (bench/controller_sim.h).
#include "bench/controller_sim.h"

#include <cstdio>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::bench {
namespace {

using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

ControllerSimOptions Scenario() {
  ControllerSimOptions o;
  o.ranks = 8;
  o.elements = 1 << 16;
  o.topology = "ring";
  o.steps = 80;
  // Steps 25..54: the magnitudes' spread narrows (ln-sd 1.22 -> 0.5), which raises the error at
  // 5 bits from 6e-4 to 7e-3; from step 55 the data is as before.
  o.shift_step = 25;
  o.revert_step = 55;
  o.magnitude_sigma_before = 1.22;
  o.magnitude_sigma_after = 0.5;
  o.apply_delay = 2;  // as dynamiqd: a change decided after collective t applies at t + 3
  o.initial_bits = 5.0;
  o.policy.target_vnmse = 1e-3;
  return o;
}

TEST(ControllerSimTest, MeetsTheTargetAfterAShiftWithFewerBitsThanAnyFixedBudgetThatMeetsItThroughout) {
  const ControllerSimOptions o = Scenario();
  const double target = o.policy.target_vnmse;
  // Every quarter bit from 3 to 8 as a fixed budget, on the same data in the same pass.
  std::vector<double> grid;
  for (int q = 12; q <= 32; ++q) grid.push_back(q * 0.25);
  absl::StatusOr<SimResult> result = RunControllerSim(o, grid);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::vector<SimStep>& steps = result->steps;
  ASSERT_EQ(steps.size(), static_cast<size_t>(o.steps));

  // The shift matters: at the starting budget the error goes over the target by several times.
  const size_t start = 8;  // grid[8] = 5 bits
  ASSERT_DOUBLE_EQ(grid[start], 5.0);
  EXPECT_LE(result->fixed_vnmse[start][o.shift_step - 1], target);
  EXPECT_GT(result->fixed_vnmse[start][o.shift_step], 3 * target);

  // The guarantee: a raise is decided by the 2nd sample above target (raise_votes), and applies
  // apply_delay steps later; the error is under target from then on. Before the shift, and after
  // the data goes back, it is under target at every step.
  const int reaction = o.tuning.raise_votes + o.apply_delay;
  for (const SimStep& s : steps) {
    const bool in_reaction = s.step >= o.shift_step && s.step < o.shift_step + reaction;
    if (!in_reaction) {
      EXPECT_LE(s.vnmse, target) << "step " << s.step << " at " << s.bits << " bits";
    }
  }
  EXPECT_GT(steps[o.shift_step + reaction].bits, steps[o.shift_step - 1].bits);

  // The comparison: the smallest fixed budget that keeps the error under target at every step.
  const std::optional<double> best_fixed = SmallestFixedBudgetMeeting(*result, target);
  ASSERT_TRUE(best_fixed.has_value());
  double mean_bits = 0, mean_wire_bits = 0, max_bits = 0;
  for (const SimStep& s : steps) {
    mean_bits += s.bits / steps.size();
    mean_wire_bits += s.wire_bits / steps.size();
    max_bits = std::max(max_bits, s.bits);
  }
  EXPECT_LT(mean_bits, *best_fixed);
  // Fixed budgets under best_fixed exceed the target somewhere (the grid search is real).
  for (size_t i = 0; i < grid.size() && grid[i] < *best_fixed; ++i) {
    bool exceeded = false;
    for (double v : result->fixed_vnmse[i]) exceeded |= v > target;
    EXPECT_TRUE(exceeded) << grid[i];
  }
  // After the data goes back, bits are given back.
  EXPECT_LT(steps.back().bits, max_bits);
  // The samples of the collectives that still ran the old budget were ignored, not acted on.
  EXPECT_GT(result->controller.samples_stale, 0u);
  EXPECT_EQ(result->controller.samples_invalid, 0u);

  std::printf(
      "controller: mean b̄ %.3f (wire %.3f bits/coord), max %.2f; smallest fixed b̄ meeting %.0e at every "
      "step: %.2f; raises %d, lowers %d, stale samples ignored %d\n",
      mean_bits, mean_wire_bits, max_bits, target, *best_fixed, static_cast<int>(result->controller.raises),
      static_cast<int>(result->controller.lowers), static_cast<int>(result->controller.samples_stale));
}

TEST(ControllerSimTest, RejectsBadOptions) {
  ControllerSimOptions o = Scenario();
  o.steps = 2;
  o.policy.target_vnmse = 0;
  EXPECT_THAT(RunControllerSim(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_vnmse")));
  o = Scenario();
  o.ranks = 1;
  EXPECT_THAT(RunControllerSim(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ranks")));
  o = Scenario();
  o.topology = "star";
  EXPECT_THAT(RunControllerSim(o), StatusIs(absl::StatusCode::kInvalidArgument));
  o = Scenario();
  EXPECT_THAT(RunControllerSim(o, {9.0}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3..8")));
}

}  // namespace
}  // namespace dynamiq::bench
