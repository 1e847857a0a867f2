#include "server/step_budget_planner.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"

namespace dynamiq::server {
namespace {

using kernels::CodecConfig;
using kernels::CodecId;

// The codec's error curve shape: about 4x less per extra bit.
kernels::WidthErrors Errors() {
  kernels::WidthErrors e{};
  for (int w = 2; w <= 8; ++w) e[w] = 0.3 * std::pow(0.26, w - 2);
  return e;
}

CodecConfig Dynamiq(double bits) {
  CodecConfig c;
  c.id = CodecId::kDynamiq;
  c.bits = bits;
  return c;
}

// `m` super-groups of energies around `scale`.
std::vector<double> Energies(size_t m, double scale) {
  std::vector<double> e(m);
  for (size_t j = 0; j < m; ++j) e[j] = scale * (1.0 + 0.5 * std::sin(0.7 * static_cast<double>(j)));
  return e;
}

// One step: a large quiet bucket, then a small loud one (a CNN's dense and conv layers).
void RecordStep(StepBudgetPlanner& p, const CodecConfig& c) {
  p.Record("model.bucket0", 400 * 256, Energies(400, 1.0), c, Errors());
  p.Record("model.bucket1", 40 * 256 - 7, Energies(40, 50.0), c, Errors());
}

TEST(StepBudgetPlannerTest, SharesOnlyOnceAStepIsComplete) {
  StepBudgetPlanner p;
  const CodecConfig c = Dynamiq(5);
  RecordStep(p, c);
  EXPECT_EQ(p.BitsFor("model.bucket0", c), 0);
  EXPECT_EQ(p.BitsFor("model.bucket1", c), 0);
  EXPECT_EQ(p.planned_buckets(), 0u);
  // bucket0 again: the first step is complete.
  p.Record("model.bucket0", 400 * 256, Energies(400, 1.0), c, Errors());
  EXPECT_EQ(p.planned_buckets(), 2u);
  const double quiet = p.BitsFor("model.bucket0", c), loud = p.BitsFor("model.bucket1", c);
  EXPECT_LT(quiet, 5);
  EXPECT_GT(loud, 6.5);
  EXPECT_LE(loud, 8);
  // Whole thousandths (the step header's resolution), and the step stays within its budget.
  EXPECT_EQ(quiet * 1000, std::round(quiet * 1000));
  EXPECT_EQ(loud * 1000, std::round(loud * 1000));
  EXPECT_LE(quiet * 400 * 256 + loud * (40 * 256 - 7), 5.0 * (440 * 256 - 7));
  EXPECT_GT(quiet * 400 * 256 + loud * (40 * 256 - 7), 4.95 * (440 * 256 - 7));
  EXPECT_EQ(p.BitsFor("model.bucket2", c), 0);  // not in the last step
}

TEST(StepBudgetPlannerTest, SameInputsSameSharesOnEveryNode) {
  StepBudgetPlanner a, b;
  const CodecConfig c = Dynamiq(4.5);
  for (StepBudgetPlanner* p : {&a, &b}) {
    RecordStep(*p, c);
    RecordStep(*p, c);
  }
  EXPECT_EQ(a.BitsFor("model.bucket0", c), b.BitsFor("model.bucket0", c));
  EXPECT_EQ(a.BitsFor("model.bucket1", c), b.BitsFor("model.bucket1", c));
  EXPECT_GT(a.BitsFor("model.bucket1", c), 0);
}

TEST(StepBudgetPlannerTest, AnotherBudgetOrCodecStartsOver) {
  StepBudgetPlanner p;
  const CodecConfig five = Dynamiq(5), six = Dynamiq(6);
  RecordStep(p, five);
  RecordStep(p, five);
  ASSERT_GT(p.BitsFor("model.bucket1", five), 0);
  EXPECT_EQ(p.BitsFor("model.bucket1", six), 0);  // shares split 5 bits, not 6
  CodecConfig mx;
  mx.id = CodecId::kMxfp8;
  EXPECT_EQ(p.BitsFor("model.bucket1", mx), 0);
  p.Record("model.bucket0", 400 * 256, Energies(400, 1.0), mx, Errors());  // ignored
  EXPECT_GT(p.BitsFor("model.bucket1", five), 0);
  // A collective under 6 bits drops the 5-bit shares and the partial step.
  p.Record("model.bucket0", 400 * 256, Energies(400, 1.0), six, Errors());
  EXPECT_EQ(p.BitsFor("model.bucket1", five), 0);
  EXPECT_EQ(p.planned_buckets(), 0u);
  p.Record("model.bucket1", 40 * 256 - 7, Energies(40, 50.0), six, Errors());
  p.Record("model.bucket0", 400 * 256, Energies(400, 1.0), six, Errors());
  EXPECT_GT(p.BitsFor("model.bucket1", six), 7);
}

TEST(StepBudgetPlannerTest, ResetForgetsEverything) {
  StepBudgetPlanner p;
  const CodecConfig c = Dynamiq(5);
  RecordStep(p, c);
  RecordStep(p, c);
  ASSERT_EQ(p.planned_buckets(), 2u);
  p.Reset();
  EXPECT_EQ(p.planned_buckets(), 0u);
  EXPECT_EQ(p.BitsFor("model.bucket1", c), 0);
  RecordStep(p, c);  // one step recorded since the reset: nothing planned yet
  EXPECT_EQ(p.BitsFor("model.bucket1", c), 0);
}

TEST(StepBudgetPlannerTest, OneBucketPerStepKeepsTheJobsBudget) {
  StepBudgetPlanner p;
  const CodecConfig c = Dynamiq(5);
  for (int step = 0; step < 3; ++step) p.Record("all_reduce.0", 300 * 256, Energies(300, 2.0), c, Errors());
  const double bits = p.BitsFor("all_reduce.0", c);
  EXPECT_LE(bits, 5);
  EXPECT_GT(bits, 4.95);
}

TEST(StepBudgetPlannerTest, NamesThatNeverRepeatKeepABoundedWindow) {
  // The torch backend once named every collective anew ("torch.allreduce.<seq>"): no bucket ever
  // came round again, so the step being recorded (and its energies) grew with every collective.
  StepBudgetPlanner p;
  const CodecConfig c = Dynamiq(5);
  const size_t total = StepBudgetPlanner::kMaxStepBuckets + 3000;
  for (size_t k = 0; k < total; ++k) {
    p.Record(absl::StrCat("torch.allreduce.", k), 256, Energies(1, 1.0), c, Errors());
    ASSERT_LE(p.recording_buckets(), StepBudgetPlanner::kMaxStepBuckets) << k;
  }
  EXPECT_EQ(p.recording_buckets(), StepBudgetPlanner::kMaxStepBuckets);
  EXPECT_EQ(p.planned_buckets(), 0u);
  // A real step still completes (the first time with the window before it) and is planned.
  for (int step = 0; step < 3; ++step) RecordStep(p, c);
  EXPECT_EQ(p.planned_buckets(), 2u);
  EXPECT_GT(p.BitsFor("model.bucket1", c), 5);
  EXPECT_EQ(p.recording_buckets(), 2u);
  // Energies are bounded too: a few huge buckets keep only what fits (always the newest).
  StepBudgetPlanner q;
  const size_t big = StepBudgetPlanner::kMaxStepSuperGroups / 3 + 1;
  for (int k = 0; k < 5; ++k) {
    q.Record(absl::StrCat("huge.", k), big * 256, std::vector<double>(big, 1.0), c, Errors());
    ASSERT_LE(q.recording_super_groups(), StepBudgetPlanner::kMaxStepSuperGroups) << k;
  }
  EXPECT_EQ(q.recording_buckets(), 2u);
}

}  // namespace
}  // namespace dynamiq::server
