// JobConfig's proto forms and the merge of a partial compression change (server/job_config.h).
#include "server/job_config.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_info.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

JobConfig Dynamiq5() { return *MakeJobConfig("dynamiq", 5, "ring", 1024, "measured"); }

JobConfig WithBudget(double target, double min_bits, double max_bits) {
  JobConfig c = Dynamiq5();
  ErrorBudgetPolicy policy;
  policy.target_vnmse = target;
  policy.min_bits = min_bits;
  policy.max_bits = max_bits;
  EXPECT_THAT(SetErrorBudget(policy, c), IsOk());
  return c;
}

absl::StatusOr<JobConfig> Apply(const JobConfig& newest, const dynamiq::v1::CompressionConfig& change) {
  return ApplyCompressionChange(newest, change, "j");
}

TEST(JobConfigTest, ProtoRoundTripIsExact) {
  JobConfig c = WithBudget(1e-3, 4, 7);
  c.codec.bits = 5.123456789012345;
  c.topology = engine::Topology::kButterfly;
  dynamiq::v1::CompressionConfig proto;
  ToProto(c, &proto);
  EXPECT_TRUE(proto.has_codec() && proto.has_bits() && proto.has_topology() && proto.has_min_compress_elements() &&
              proto.has_allocator());
  absl::StatusOr<JobConfig> back = FromProto(proto);
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(back->codec.bits, c.codec.bits);
  EXPECT_EQ(back->topology, engine::Topology::kButterfly);
  EXPECT_EQ(back->min_compress_elements, 1024u);
  ASSERT_TRUE(back->error_budget.has_value());
  EXPECT_EQ(back->error_budget->target_vnmse, 1e-3);
  EXPECT_EQ(back->error_budget->max_bits, 7);
}

TEST(JobConfigTest, UnsetFieldsKeepTheNewestValues) {
  dynamiq::v1::CompressionConfig change;
  change.set_topology("butterfly");
  absl::StatusOr<JobConfig> c = Apply(Dynamiq5(), change);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->codec.id, kernels::CodecId::kDynamiq);
  EXPECT_EQ(c->codec.bits, 5);
  EXPECT_EQ(c->topology, engine::Topology::kButterfly);
  EXPECT_EQ(c->min_compress_elements, 1024u);
}

TEST(JobConfigTest, ANewCodecWithoutBitsGetsItsDefault) {
  dynamiq::v1::CompressionConfig change;
  change.set_codec("thc");  // bits mean something else per codec: thc's default, 4
  absl::StatusOr<JobConfig> c = Apply(Dynamiq5(), change);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->codec.id, kernels::CodecId::kThc);
  EXPECT_EQ(c->codec.bits, 4);
  change.set_codec("mxfp8");
  c = Apply(Dynamiq5(), change);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->codec.bits, 0);  // no bit setting
  // The same codec named again keeps the bits.
  change.set_codec("dynamiq");
  c = Apply(Dynamiq5(), change);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->codec.bits, 5);
}

// Issue 44.6: bits on a codec without a bit setting were shown (int8/3.7, bf16/4) but never used;
// they are refused, whether the change names the codec or the job already runs it. 0 stays "the
// codec's default".
TEST(JobConfigTest, BitsForACodecWithoutABitSettingAreRefused) {
  dynamiq::v1::CompressionConfig change;
  change.set_codec("int8");
  change.set_bits(3.7);
  EXPECT_THAT(Apply(Dynamiq5(), change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("codec int8 has no bit setting")));
  change.set_codec("bf16");
  change.set_bits(4);
  EXPECT_THAT(Apply(Dynamiq5(), change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("codec bf16 has no bit setting")));
  change.set_bits(0);
  absl::StatusOr<JobConfig> bf16 = Apply(Dynamiq5(), change);
  ASSERT_THAT(bf16, IsOk());
  EXPECT_EQ(bf16->codec.bits, 0);
  change.Clear();
  change.set_bits(6);  // the job runs bf16: bits alone are refused too
  EXPECT_THAT(Apply(*bf16, change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("codec bf16 has no bit setting")));
  EXPECT_THAT(MakeJobConfig("int8", 5, "ring", 0, "measured"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int8 has no bit setting")));
}

// Issue 44.2: bits 0 (dynamiqd without --bits) is each codec's own default, from the codec table.
TEST(JobConfigTest, ZeroBitsIsEachCodecsDefault) {
  for (const kernels::CodecInfo& info : kernels::AllCodecs()) {
    absl::StatusOr<JobConfig> c = MakeJobConfig(info.name, 0, "ring", 0, "measured");
    ASSERT_THAT(c, IsOk()) << info.name;
    EXPECT_EQ(c->codec.bits, info.default_bits) << info.name;
  }
  EXPECT_EQ(MakeJobConfig("arc_topk", 0, "ring", 0, "measured")->codec.bits, 0.1);
  EXPECT_EQ(MakeJobConfig("global_qsgd", 0, "ring", 0, "measured")->codec.bits, 8);
}

TEST(JobConfigTest, ABudgetSwitchesToDynamiqAndStartsInItsRange) {
  JobConfig mx = *MakeJobConfig("mxfp8", 0, "ring", 0, "measured");
  dynamiq::v1::CompressionConfig change;
  change.mutable_error_budget()->set_target_vnmse(1e-3);
  change.mutable_error_budget()->set_min_bits(6);
  absl::StatusOr<JobConfig> c = Apply(mx, change);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->codec.id, kernels::CodecId::kDynamiq);
  EXPECT_EQ(c->codec.bits, 6);  // the default 5, clamped to [6, 8]
  ASSERT_TRUE(c->error_budget.has_value());
  EXPECT_EQ(c->error_budget->min_bits, 6);
  EXPECT_EQ(c->error_budget->max_bits, 8);
  // Naming another codec with a budget is refused.
  change.set_codec("mxfp8");
  EXPECT_THAT(Apply(mx, change), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs codec dynamiq")));
}

TEST(JobConfigTest, BudgetFieldsChangeTheCurrentBudgetOrNeedOne) {
  dynamiq::v1::CompressionConfig change;
  change.mutable_error_budget()->set_max_bits(6);
  absl::StatusOr<JobConfig> c = Apply(WithBudget(1e-3, 4, 7), change);
  ASSERT_THAT(c, IsOk());
  ASSERT_TRUE(c->error_budget.has_value());
  EXPECT_EQ(c->error_budget->target_vnmse, 1e-3);
  EXPECT_EQ(c->error_budget->min_bits, 4);
  EXPECT_EQ(c->error_budget->max_bits, 6);
  EXPECT_THAT(Apply(Dynamiq5(), change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job j has no error budget")));
  // Target 0 ends the budget and takes no other budget field.
  change.mutable_error_budget()->set_target_vnmse(0);
  EXPECT_THAT(Apply(WithBudget(1e-3, 4, 7), change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("takes no min_bits")));
  change.mutable_error_budget()->clear_max_bits();
  c = Apply(WithBudget(1e-3, 4, 7), change);
  ASSERT_THAT(c, IsOk());
  EXPECT_FALSE(c->error_budget.has_value());
}

TEST(JobConfigTest, BitsOrCodecAloneReturnToFixedBitsOtherChangesKeepTheBudget) {
  dynamiq::v1::CompressionConfig change;
  change.set_min_compress_elements(64);
  absl::StatusOr<JobConfig> c = Apply(WithBudget(1e-3, 4, 7), change);
  ASSERT_THAT(c, IsOk());
  EXPECT_TRUE(c->error_budget.has_value());
  change.set_bits(6);
  c = Apply(WithBudget(1e-3, 4, 7), change);
  ASSERT_THAT(c, IsOk());
  EXPECT_FALSE(c->error_budget.has_value());
  EXPECT_EQ(c->codec.bits, 6);
}

// The loss-tolerant all-reduce's phase: kept across other changes, described, round-tripped; it
// takes codecs none, bf16 and int8 only, no error budget, and 0..60000 ms.
TEST(JobConfigTest, ALossyPhaseTakesNoneBf16OrInt8AndNoBudget) {
  dynamiq::v1::CompressionConfig change;
  change.set_codec("int8");
  change.set_lossy_phase_ms(40);
  absl::StatusOr<JobConfig> lossy = Apply(Dynamiq5(), change);
  ASSERT_THAT(lossy, IsOk());
  EXPECT_EQ(lossy->lossy_phase, absl::Milliseconds(40));
  EXPECT_THAT(DescribeJobConfig(*lossy), HasSubstr("lossy_phase=40ms"));
  dynamiq::v1::CompressionConfig proto;
  ToProto(*lossy, &proto);
  EXPECT_EQ(proto.lossy_phase_ms(), 40);
  change.Clear();
  change.set_codec("bf16");  // another carried codec: the phase stays
  absl::StatusOr<JobConfig> bf16 = Apply(*lossy, change);
  ASSERT_THAT(bf16, IsOk());
  EXPECT_EQ(bf16->lossy_phase, absl::Milliseconds(40));
  change.set_codec("dynamiq");
  EXPECT_THAT(Apply(*lossy, change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("carries codec none, bf16 or int8, not dynamiq")));
  change.set_lossy_phase_ms(0);  // back to reliable with the codec change
  EXPECT_THAT(Apply(*lossy, change), IsOk());
  change.Clear();
  change.mutable_error_budget()->set_target_vnmse(1e-3);
  change.set_lossy_phase_ms(40);
  EXPECT_THAT(Apply(Dynamiq5(), change), StatusIs(absl::StatusCode::kInvalidArgument));
  for (double bad : {-1.0, 60001.0, std::nan("")}) {
    change.Clear();
    change.set_codec("none");
    change.set_lossy_phase_ms(bad);
    EXPECT_THAT(Apply(Dynamiq5(), change), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lossy_phase_ms")))
        << bad;
  }
}

TEST(JobConfigTest, InvalidValuesAreInvalidArgument) {
  dynamiq::v1::CompressionConfig change;
  change.set_bits(99);
  EXPECT_THAT(Apply(Dynamiq5(), change), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bits")));
  change.Clear();
  change.set_codec("zstd");
  EXPECT_THAT(Apply(Dynamiq5(), change), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("zstd")));
  change.Clear();
  change.set_codec("");  // explicitly empty is not "unset"
  EXPECT_THAT(Apply(Dynamiq5(), change), StatusIs(absl::StatusCode::kInvalidArgument));
  change.Clear();
  change.set_topology(std::string("ri\0ng", 5));
  EXPECT_THAT(Apply(Dynamiq5(), change), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("topology")));
  change.Clear();
  change.mutable_error_budget()->set_target_vnmse(2);
  EXPECT_THAT(Apply(Dynamiq5(), change), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_vnmse")));
}

TEST(JobConfigTest, AnErrorBudgetNeedsErrorSamplesBetweenNodes) {
  const JobConfig budget = WithBudget(1e-3, 3, 8);
  EXPECT_THAT(CheckErrorBudgetSampled(Dynamiq5(), 1, 0), IsOk());  // no budget: nothing to sample
  EXPECT_THAT(CheckErrorBudgetSampled(budget, 2, 0.01), IsOk());
  EXPECT_THAT(CheckErrorBudgetSampled(budget, 1, 0.01),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("two or more nodes")));
  EXPECT_THAT(CheckErrorBudgetSampled(budget, 2, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--error_sample_rate is 0")));
  JobConfig own_rate = budget;
  own_rate.error_budget->sample_rate = 0.1;  // the budget samples on its own
  EXPECT_THAT(CheckErrorBudgetSampled(own_rate, 2, 0), IsOk());
}

}  // namespace
}  // namespace dynamiq::server
