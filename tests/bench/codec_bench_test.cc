// dynamiq-bench codec on the user's own files (--input).
#include "bench/codec_bench.h"

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dynamiq::bench {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string WriteFloats(const std::string& name, const std::vector<float>& v) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
  return path;
}

TEST(CodecBenchTest, TableAndJsonReportTheInputFilesLengthNotSize) {
  std::vector<float> a(1000), b(1000);
  for (int i = 0; i < 1000; ++i) a[i] = 0.01f * (i % 17) - 0.05f, b[i] = 0.02f * (i % 5) - 0.03f;
  CodecBenchOptions o;
  o.workers = 2;
  o.elements = 4194304;  // --size's default: must not appear when files are given
  o.inputs = {WriteFloats("codec_bench_r0.bin", a), WriteFloats("codec_bench_r1.bin", b)};
  o.trials = 1;
  o.min_seconds = 0;
  kernels::CodecConfig c;
  c.id = kernels::CodecId::kMxfp8;
  o.configs = {c};
  auto rows = RunCodecBench(o);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].elements, 1000u);
  const std::string table = FormatTable(*rows, o);
  EXPECT_THAT(table, HasSubstr("1000 elements per worker"));
  EXPECT_THAT(table, Not(HasSubstr("4194304")));
  EXPECT_THAT(FormatRowJson((*rows)[0], o), HasSubstr("\"elements\":1000,"));
}

TEST(CodecBenchTest, OutputPrefixWritesEachRowsAllReducedResult) {
  std::vector<float> a(600), b(600);
  for (int i = 0; i < 600; ++i) a[i] = 0.25f * (i % 7), b[i] = -0.5f * (i % 3);
  CodecBenchOptions o;
  o.workers = 2;
  o.inputs = {WriteFloats("codec_bench_out_r0.bin", a), WriteFloats("codec_bench_out_r1.bin", b)};
  o.trials = 1;
  o.min_seconds = 0;
  o.output_prefix = ::testing::TempDir() + "/codec_bench_out";
  kernels::CodecConfig none;  // lossless: the file must hold the exact sum
  none.id = kernels::CodecId::kNone;
  kernels::CodecConfig mx;
  mx.id = kernels::CodecId::kMxfp8;
  kernels::CodecConfig dq;
  dq.id = kernels::CodecId::kDynamiq;
  dq.bits = 5;
  o.configs = {none, mx, dq};
  auto rows = RunCodecBench(o);
  ASSERT_TRUE(rows.ok()) << rows.status();
  for (int row = 0; row < 2; ++row) {
    std::ifstream f(o.output_prefix + "." + std::to_string(row) + ".bin", std::ios::binary | std::ios::ate);
    ASSERT_TRUE(f) << "row " << row;
    EXPECT_EQ(f.tellg(), static_cast<std::streamoff>(600 * sizeof(float)));
    std::vector<float> got(600);
    f.seekg(0);
    f.read(reinterpret_cast<char*>(got.data()), 600 * sizeof(float));
    for (int i = 0; i < 600; ++i) {
      if (row == 0) {
        ASSERT_EQ(got[i], a[i] + b[i]) << i;
      } else {
        ASSERT_NEAR(got[i], a[i] + b[i], 0.1f) << i;  // MXFP8: 3 mantissa bits
      }
    }
  }
  // Only DynamiQ has widths: one byte per 256-element super-group (600 elements: 3), each 0 or 2..8.
  EXPECT_FALSE(std::ifstream(o.output_prefix + ".1.widths"));
  std::ifstream w(o.output_prefix + ".2.widths", std::ios::binary);
  ASSERT_TRUE(w);
  const std::string widths((std::istreambuf_iterator<char>(w)), std::istreambuf_iterator<char>());
  ASSERT_EQ(widths.size(), 3u);
  for (char c : widths) EXPECT_TRUE(c == 0 || (c >= 2 && c <= 8)) << static_cast<int>(c);
}

// Two buckets of one step: `quiet` with small gradients, `loud` with 30x larger ones.
struct TwoBuckets {
  std::vector<std::string> quiet, loud;
  std::vector<std::vector<float>> quiet_data, loud_data;
};

TwoBuckets WriteTwoBuckets() {
  TwoBuckets t;
  for (int r = 0; r < 2; ++r) {
    std::vector<float> q(256 * 48), l(256 * 16);
    for (size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>((i * 7 + r * 3) % 23) - 0.11f;
    for (size_t i = 0; i < l.size(); ++i) l[i] = 0.3f * static_cast<float>((i * 5 + r * 11) % 19) - 2.7f;
    t.quiet.push_back(WriteFloats("step_quiet_r" + std::to_string(r) + ".bin", q));
    t.loud.push_back(WriteFloats("step_loud_r" + std::to_string(r) + ".bin", l));
    t.quiet_data.push_back(q);
    t.loud_data.push_back(l);
  }
  return t;
}

double Energy(const std::vector<std::vector<float>>& ranks) {
  double e = 0;
  for (size_t i = 0; i < ranks[0].size(); ++i) {
    double s = 0;
    for (const auto& r : ranks) s += r[i];
    e += s * s;
  }
  return e;
}

// vNMSE of dynamiq at `bits` on one bucket's files.
double DynamiqVnmse(const std::vector<std::string>& files, double bits) {
  CodecBenchOptions o;
  o.workers = 2;
  o.inputs = files;
  o.trials = 3;
  o.min_seconds = 0;
  kernels::CodecConfig c;
  c.bits = bits;
  o.configs = {c};
  auto rows = RunCodecBench(o);
  EXPECT_TRUE(rows.ok()) << rows.status();
  return rows.ok() ? (*rows)[0].vnmse : 0;
}

TEST(StepBudgetTest, LouderBucketGetsMoreBitsAndTheStepLessError) {
  const TwoBuckets t = WriteTwoBuckets();
  kernels::CodecConfig c;
  c.bits = 5;
  auto rows = PlanStepBudgets({t.quiet, t.loud}, 2, {c}, 3, 8);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 2u);
  const StepBudgetRow& quiet = (*rows)[0];
  const StepBudgetRow& loud = (*rows)[1];
  EXPECT_EQ(quiet.bucket, 0u);
  EXPECT_EQ(quiet.elements, 256u * 48);
  EXPECT_EQ(loud.elements, 256u * 16);
  EXPECT_EQ(loud.bits_target, 5);
  EXPECT_GT(loud.bits, 6.5);
  EXPECT_LT(quiet.bits, 5);
  const double average = (quiet.bits * quiet.elements + loud.bits * loud.elements) / (256.0 * 64);
  EXPECT_LE(average, 5 + 1e-9);
  EXPECT_GT(average, 4.9);
  EXPECT_THAT(FormatStepBudgetJson(loud), HasSubstr("\"bucket\":1,\"elements\":4096,"));
  // The step's error (energy-weighted over its buckets) at the same bits, per bucket vs per step.
  const double eq = Energy(t.quiet_data), el = Energy(t.loud_data);
  const double per_bucket = DynamiqVnmse(t.quiet, 5) * eq + DynamiqVnmse(t.loud, 5) * el;
  const double per_step = DynamiqVnmse(t.quiet, quiet.bits) * eq + DynamiqVnmse(t.loud, loud.bits) * el;
  EXPECT_LT(per_step, 0.5 * per_bucket);
}

TEST(StepBudgetTest, ResultEnergySeesRanksThatCancel) {
  // Bucket 0: both ranks hold the same values (the sum doubles them); bucket 1: rank 1 holds the
  // negation of rank 0 (the sum is zero). The statistics see equal energy; the result sees only
  // bucket 0's.
  std::vector<float> a(256 * 32), neg(a.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.05f * static_cast<float>((i * 7) % 19) - 0.45f, neg[i] = -a[i];
  const std::vector<std::string> same = {WriteFloats("step_same_r0.bin", a), WriteFloats("step_same_r1.bin", a)};
  const std::vector<std::string> cancel = {WriteFloats("step_cancel_r0.bin", a),
                                           WriteFloats("step_cancel_r1.bin", neg)};
  kernels::CodecConfig c;
  c.bits = 5;
  auto by_stats = PlanStepBudgets({same, cancel}, 2, {c}, 3, 8, StepEnergy::kStatistics);
  auto by_result = PlanStepBudgets({same, cancel}, 2, {c}, 3, 8, StepEnergy::kResult);
  ASSERT_TRUE(by_stats.ok()) << by_stats.status();
  ASSERT_TRUE(by_result.ok()) << by_result.status();
  // Equal energies: equal shares up to the tie-broken upgrades of the joint allocation.
  EXPECT_NEAR((*by_stats)[0].bits, (*by_stats)[1].bits, 1.0);
  EXPECT_GT((*by_stats)[1].bits, 4.5);
  EXPECT_EQ((*by_result)[1].bits, 3);  // all-zero result: the minimum
  EXPECT_GT((*by_result)[0].bits, 6.5);
}

TEST(StepBudgetTest, RejectsMismatchedFilesAndEmptySteps) {
  const TwoBuckets t = WriteTwoBuckets();
  kernels::CodecConfig c;
  EXPECT_FALSE(PlanStepBudgets({}, 2, {c}, 3, 8).ok());
  EXPECT_FALSE(PlanStepBudgets({t.quiet}, 3, {c}, 3, 8).ok());                  // 2 files for 3 workers
  EXPECT_FALSE(PlanStepBudgets({{t.quiet[0], t.loud[1]}}, 2, {c}, 3, 8).ok());  // sizes differ
  EXPECT_FALSE(PlanStepBudgets({t.quiet}, 2, {c}, 8, 3).ok());
}

}  // namespace
}  // namespace dynamiq::bench
