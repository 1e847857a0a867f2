#include "engine/block_plan.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "engine/schedule.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using kernels::BucketPlan;
using ::testing::HasSubstr;

std::unique_ptr<kernels::Codec> Make(kernels::CodecId id) {
  kernels::CodecConfig c;
  c.id = id;
  if (id == kernels::CodecId::kThc) c.bits = 4;
  return std::move(kernels::CreateCodec(c)).value();
}

TEST(BlockPlanTest, BlocksAreWholeSuperGroups) {
  EXPECT_EQ(BlockElements(1000, 0), 1024u) << "0 = the whole bucket, rounded up";
  EXPECT_EQ(BlockElements(1000, 300), 512u);
  EXPECT_EQ(BlockElements(1000, 1), 256u);
  EXPECT_EQ(BlockElements(0, 0), 256u);
  EXPECT_EQ(*NumBlocks(1000, 300), 2u);
  EXPECT_EQ(*NumBlocks(0, 300), 1u) << "an empty bucket is one empty block";
  EXPECT_EQ(*NumBlocks(size_t{256} << 20, 256), kMaxBlocks);
  EXPECT_THAT(NumBlocks((size_t{256} << 20) + 1, 256),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("raise block_elements")));
}

TEST(BlockPlanTest, OnlySumStatisticsPlanPerBlock) {
  EXPECT_TRUE(PlansPerBlock(*Make(kernels::CodecId::kDynamiq)));
  EXPECT_FALSE(PlansPerBlock(*Make(kernels::CodecId::kThc))) << "maxima: one plan for the bucket";
  EXPECT_FALSE(PlansPerBlock(*Make(kernels::CodecId::kMxfp8))) << "no statistics";
}

TEST(BlockPlanTest, BlockStatisticsTileTheBucketsStatistics) {
  auto dynamiq = Make(kernels::CodecId::kDynamiq);
  const size_t d = 5000, block = 1024;
  size_t next = 0, elements = 0;
  for (size_t k = 0; k < *NumBlocks(d, block); ++k) {
    const BlockStats b = BlockStatsRange(*dynamiq, d, block, k);
    EXPECT_EQ(b.offset, next) << k;
    EXPECT_EQ(b.length, dynamiq->StatsLength(b.count)) << k;
    next += b.length;
    elements += b.count;
  }
  EXPECT_EQ(next, dynamiq->StatsLength(d));
  EXPECT_EQ(elements, d);
}

TEST(BlockPlanTest, SlicesJoinBackIntoTheBucketPlan) {
  BucketPlan bucket;
  bucket.round = kernels::RoundInfo{7, 2, 4};
  bucket.num_elements = 1000;  // 4 super-groups
  bucket.widths = {2, 4, 8, 5};
  bucket.local_means = {0.5f, 1.5f, 2.5f, 3.5f};
  bucket.mean_sums = {2.0f, 6.0f, 10.0f, 14.0f};
  std::vector<BucketPlan> blocks;
  for (size_t k = 0, begin = 0; begin < 1000; ++k, begin += 512) {
    blocks.push_back(SliceBucketPlan(bucket, 7, k, begin, std::min<size_t>(512, 1000 - begin)));
    EXPECT_EQ(blocks.back().round.round, 7 * kMaxBlocks + k);
    EXPECT_EQ(blocks.back().round.rank, 2u);
  }
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[1].widths, (std::vector<uint8_t>{8, 5}));
  EXPECT_EQ(blocks[1].num_elements, 488u);
  const BucketPlan joined = JoinBlockPlans(blocks, 7);
  EXPECT_EQ(joined.num_elements, bucket.num_elements);
  EXPECT_EQ(joined.widths, bucket.widths);
  EXPECT_EQ(joined.local_means, bucket.local_means);
  EXPECT_EQ(joined.mean_sums, bucket.mean_sums);
  EXPECT_EQ(joined.round.round, 7u);
}

}  // namespace
}  // namespace dynamiq::engine

namespace dynamiq::engine {
namespace {

// A DynamiQ plan of a skewed bucket: the first quarter of the super-groups 1000x larger.
BucketPlan SkewedDynamiqPlan(const kernels::Codec& codec, size_t d, uint32_t n) {
  std::vector<float> x(d);
  for (size_t i = 0; i < d; ++i) x[i] = (i < d / 4 ? 1000.0f : 1.0f) * static_cast<float>((i * 7919) % 1013) / 1013;
  kernels::Source src{x.data(), kernels::DType::kFloat32, 0, nullptr};
  std::vector<float> stats(codec.StatsLength(d));
  codec.ComputeStats(src, d, stats.data());
  std::vector<float> reduced = stats;
  for (float& s : reduced) s *= n;
  return codec.MakePlan(kernels::RoundInfo{1, 0, n}, d, stats, reduced).value();
}

size_t ChunkBytes(const kernels::Codec& codec, const BucketPlan& plan, const kernels::ChunkRef& c) {
  return codec.MaxEncodedBytes(plan, c);
}

TEST(BalancedChunksTest, CoverTheBlockOnSuperGroupsAndEvenOutTheBytes) {
  kernels::CodecConfig config;
  config.id = kernels::CodecId::kDynamiq;
  config.bits = 5;
  auto codec = std::move(kernels::CreateCodec(config)).value();
  const size_t d = 64 * 256 + 100;
  for (uint32_t n : {2u, 3u, 4u, 8u}) {
    const BucketPlan plan = SkewedDynamiqPlan(*codec, d, n);
    const std::vector<kernels::ChunkRef> balanced = BalancedChunks(*codec, plan, static_cast<int>(n));
    ASSERT_EQ(balanced.size(), n);
    size_t next = 0, most_balanced = 0, most_equal = 0;
    for (uint32_t c = 0; c < n; ++c) {
      EXPECT_EQ(balanced[c].chunk_id, c);
      EXPECT_EQ(balanced[c].begin, next) << "contiguous, in order";
      EXPECT_TRUE(balanced[c].begin % 256 == 0 || balanced[c].count == 0) << "on super-group boundaries";
      next = balanced[c].begin + balanced[c].count;
      most_balanced = std::max(most_balanced, ChunkBytes(*codec, plan, balanced[c]));
      most_equal = std::max(most_equal, ChunkBytes(*codec, plan, ChunkOf(d, static_cast<int>(n), static_cast<int>(c))));
    }
    EXPECT_EQ(next, d) << "the chunks cover the block";
    EXPECT_LT(most_balanced, most_equal) << n << " ranks: the skewed plan's largest chunk shrinks";
  }
  // Equal costs per super-group: the same split as ChunkOf.
  auto none = Make(kernels::CodecId::kNone);
  BucketPlan flat;
  flat.round = kernels::RoundInfo{1, 0, 4};
  flat.num_elements = 16 * 256;
  const auto chunks = BalancedChunks(*none, flat, 4);
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(chunks[c].begin, ChunkOf(flat.num_elements, 4, c).begin);
    EXPECT_EQ(chunks[c].count, ChunkOf(flat.num_elements, 4, c).count);
  }
}

}  // namespace
}  // namespace dynamiq::engine
