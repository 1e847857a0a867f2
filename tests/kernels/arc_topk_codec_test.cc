#include "kernels/cpu/arc_topk_codec.h"
#include "tests/kernels/codec_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/arc_topk_math.h"
#include "kernels/codec_registry.h"
#include "kernels/wire_format.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::StatusIs;
using testing::Dst;
using ::testing::HasSubstr;
using testing::MustCompress;
using testing::MustDar;
using testing::MustDecompress;
using testing::Src;

constexpr uint64_t kSeed = 0x5eed5eed5eed5eedull;

CodecConfig Config(double density = 0.25) {
  CodecConfig c;
  c.id = CodecId::kArcTopK;
  c.bits = density;
  c.seed = kSeed;
  return c;
}

std::unique_ptr<Codec> MustCreate(double density = 0.25) {
  auto codec = CreateCodec(Config(density));
  EXPECT_TRUE(codec.ok()) << codec.status();
  return codec.ok() ? *std::move(codec) : nullptr;
}

// Rows of 256 with row g's scale scales[g] (Gaussian within a row).
std::vector<float> Rows(const std::vector<float>& scales, uint32_t seed, size_t n = 0) {
  if (n == 0) n = scales.size() * 256;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = dist(rng) * scales[i / 256];
  return v;
}

// Sums the ranks' statistics, as the engine's SUM exchange would (without its bf16 rounding).
BucketPlan MustPlan(const Codec& codec, size_t n, uint64_t round, uint32_t rank, uint32_t world_size,
                    const std::vector<const std::vector<float>*>& all_ranks) {
  const size_t len = codec.StatsLength(n);
  EXPECT_EQ(len, 4 * ((n + 255) / 256));
  EXPECT_EQ(codec.stats_reduction(), StatsReduction::kSum);
  std::vector<float> reduced(len, 0.0f), local(len);
  for (size_t r = 0; r < all_ranks.size(); ++r) {
    std::vector<float> s(len, -1.0f);
    codec.ComputeStats(Src(*all_ranks[r]), n, s.data());
    for (size_t k = 0; k < len; ++k) reduced[k] += s[k];
    if (r == rank) local = s;
  }
  auto plan = codec.MakePlan(RoundInfo{round, rank, world_size}, n, local, reduced);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

size_t Kept(const BucketPlan& plan) { return std::count(plan.widths.begin(), plan.widths.end(), 1); }

TEST(ArcTopKMathTest, KeptRows) {
  EXPECT_EQ(ArcTopKKeptRows(0, 0.5), 0u);
  EXPECT_EQ(ArcTopKKeptRows(10, 0.001), 1u);
  EXPECT_EQ(ArcTopKKeptRows(10, 0.25), 3u);  // ceil(2.5)
  EXPECT_EQ(ArcTopKKeptRows(10, 0.2), 2u);
  EXPECT_EQ(ArcTopKKeptRows(10, 1.0), 10u);
}

TEST(ArcTopKCodecTest, RegisteredInTheCodecTable) {
  EXPECT_THAT(ParseCodecId("arc_topk"), ::dynamiq::testing::IsOkAndHolds(CodecId::kArcTopK));
  EXPECT_EQ(static_cast<int>(CodecId::kArcTopK), 10);  // part of the wire format
  const CodecInfo& info = GetCodecInfo(CodecId::kArcTopK);
  EXPECT_TRUE(info.has_bits);
  EXPECT_FALSE(info.integer_bits);
  EXPECT_FALSE(info.on_cuda);
  for (double bad : {0.0, 0.0005, 1.5}) {
    EXPECT_THAT(CreateCodec(Config(bad)).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("density")))
        << bad;
    EXPECT_EQ(NewArcTopKCodec(Config(bad)), nullptr);
  }
  auto codec = MustCreate(0.05);
  EXPECT_EQ(codec->id(), CodecId::kArcTopK);
  EXPECT_TRUE(codec->SupportsButterfly());
  EXPECT_THAT(codec->Describe(), HasSubstr("density 0.05"));
}

TEST(ArcTopKCodecTest, SelectsTheRowsOfLargestSummedNorm) {
  // 16 rows; rows 3, 9, 12 and 15 are large in the SUM. Row 5 is large on each rank but cancels
  // between the two ranks: a sketch of the sum must not pick it (per-rank norms would).
  std::vector<float> scales(16, 0.01f);
  for (int g : {3, 9, 12, 15}) scales[g] = 10.0f;
  auto a = Rows(scales, 1, 16 * 256 - 100);  // partial last row
  auto b = Rows(scales, 2, 16 * 256 - 100);
  for (size_t i = 5 * 256; i < 6 * 256; ++i) {
    a[i] = 100.0f * ((i % 7) - 3.0f);
    b[i] = -a[i];
  }
  auto codec = MustCreate(0.25);  // 4 of 16 rows
  const BucketPlan plan = MustPlan(*codec, a.size(), 1, 0, 2, {&a, &b});
  ASSERT_EQ(plan.widths.size(), 16u);
  std::vector<uint8_t> expected(16, 0);
  for (int g : {3, 9, 12, 15}) expected[g] = 1;
  EXPECT_EQ(plan.widths, expected);
  // Every rank gets the same rows: the plan is a function of the reduced statistics only.
  EXPECT_EQ(MustPlan(*codec, a.size(), 1, 1, 2, {&a, &b}).widths, plan.widths);
}

TEST(ArcTopKCodecTest, TiesGoToTheLowerRowAndZeroBucketsKeepTheFirstRows) {
  auto codec = MustCreate(0.3);
  std::vector<float> zero(10 * 256, 0.0f);
  const BucketPlan plan = MustPlan(*codec, zero.size(), 1, 0, 1, {&zero});
  EXPECT_EQ(plan.widths, std::vector<uint8_t>({1, 1, 1, 0, 0, 0, 0, 0, 0, 0}));
}

TEST(ArcTopKCodecTest, WireCarriesOnlyTheKeptValuesExactly) {
  std::vector<float> scales(8, 1.0f);
  scales[2] = scales[6] = 50.0f;
  auto x = Rows(scales, 3, 8 * 256 - 10);
  auto codec = MustCreate(0.25);  // 2 of 8 rows
  const BucketPlan plan = MustPlan(*codec, x.size(), 4, 0, 1, {&x});
  ASSERT_EQ(Kept(plan), 2u);
  const ChunkRef chunk{0, 0, x.size()};
  auto bytes = MustCompress(*codec, plan, chunk, Src(x));
  EXPECT_EQ(bytes.size(), kChunkHeaderBytes + 4 * 2 * 256);
  auto y = MustDecompress(*codec, plan, chunk, bytes);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(y[i], ArcTopKKept(plan, i) ? x[i] : 0.0f) << i;
  }
  // A chunk holding part of the bucket carries its own kept rows only.
  const ChunkRef tail{1, 768, x.size() - 768};
  auto tail_bytes = MustCompress(*codec, plan, tail, Src(x));
  EXPECT_EQ(tail_bytes.size(), kChunkHeaderBytes + 4 * 256);  // row 6 only
  auto ty = MustDecompress(*codec, plan, tail, tail_bytes);
  for (size_t i = 0; i < tail.count; ++i) ASSERT_EQ(ty[i], y[768 + i]) << i;
}

TEST(ArcTopKCodecTest, RingSumsTheSelectedValuesAndIsBitIdenticalAcrossRanks) {
  const size_t d = 12 * 256 + 7;
  const uint32_t n = 5;
  std::vector<std::vector<float>> x;
  std::vector<const std::vector<float>*> all;
  std::vector<float> scales(13);
  for (size_t g = 0; g < scales.size(); ++g) scales[g] = 0.1f + (g * 7 % 13);
  for (uint32_t r = 0; r < n; ++r) x.push_back(Rows(scales, 20 + r, d));
  for (const auto& v : x) all.push_back(&v);
  auto codec = MustCreate(0.4);
  const ChunkRef chunk{0, 0, d};
  std::vector<uint8_t> msg = MustCompress(*codec, MustPlan(*codec, d, 2, 0, n, all), chunk, Src(x[0]));
  for (uint32_t r = 1; r < n; ++r) msg = MustDar(*codec, MustPlan(*codec, d, 2, r, n, all), chunk, msg, Src(x[r]));
  EXPECT_EQ(ParseChunkHeader(msg)->num_summands, n);
  std::vector<float> first;
  for (uint32_t r = 0; r < n; ++r) {
    const BucketPlan plan = MustPlan(*codec, d, 2, r, n, all);
    auto y = MustDecompress(*codec, plan, chunk, msg);
    for (size_t i = 0; i < d; ++i) {
      float sum = 0.0f;
      for (uint32_t k = 0; k < n; ++k) sum += x[k][i];  // the ring's order of additions
      ASSERT_EQ(y[i], ArcTopKKept(plan, i) ? sum : 0.0f) << i;
    }
    if (r == 0) first = y;
    ASSERT_EQ(0, std::memcmp(first.data(), y.data(), d * sizeof(float))) << "rank " << r;
  }
  // DecompressAccumulate adds the kept values and leaves the rest alone.
  const BucketPlan plan = MustPlan(*codec, d, 2, 0, n, all);
  std::vector<float> acc(d, 1.0f);
  DQ_EXPECT_OK(codec->DecompressAccumulate(plan, chunk, msg, acc.data()));
  for (size_t i = 0; i < d; ++i) ASSERT_EQ(acc[i], 1.0f + first[i]) << i;
}

TEST(ArcTopKCodecTest, PlanRefusesNonFiniteOrMisSizedSketches) {
  auto codec = MustCreate();
  std::vector<float> x(600, 1.0f);
  x[300] = std::numeric_limits<float>::infinity();
  std::vector<float> stats(codec->StatsLength(x.size()));
  codec->ComputeStats(Src(x), x.size(), stats.data());
  EXPECT_THAT(codec->MakePlan(RoundInfo{1, 0, 2}, x.size(), stats, stats).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("row 1 is not finite")));
  EXPECT_THAT(codec->MakePlan(RoundInfo{1, 0, 2}, x.size(), stats, absl::MakeConstSpan(stats).subspan(1)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 12")));
}

class ArcTopKMalformedTest : public ::testing::Test {
 protected:
  static constexpr size_t kN = 1000;
  static constexpr uint32_t kWorld = 4;
  ArcTopKMalformedTest() : codec_(MustCreate(0.5)), chunk_{1, 256, kN - 256} {
    std::vector<float> scales(4, 1.0f);
    scales[1] = scales[3] = 9.0f;
    x_ = Rows(scales, 5, kN);
    leaf_plan_ = MustPlan(*codec_, kN, 11, 0, kWorld, {&x_});
    plan_ = MustPlan(*codec_, kN, 11, 2, kWorld, {&x_});
    leaf_ = MustCompress(*codec_, leaf_plan_, chunk_, Src(x_));
    aggregated_ = MustDar(*codec_, MustPlan(*codec_, kN, 11, 1, kWorld, {&x_}), chunk_, leaf_, Src(x_));
  }

  void ExpectRejected(const std::vector<uint8_t>& bytes, absl::StatusCode code, const std::string& substr) {
    testing::ExpectChunkRejected(*codec_, plan_, chunk_, Src(x_), bytes, code, substr);
  }

  static std::vector<uint8_t> WithHeader(std::vector<uint8_t> bytes, const std::function<void(ChunkHeader&)>& edit) {
    return testing::WithChunkHeader(std::move(bytes), edit);
  }

  std::unique_ptr<Codec> codec_;
  std::vector<float> x_;
  ChunkRef chunk_;
  BucketPlan leaf_plan_, plan_;
  std::vector<uint8_t> leaf_, aggregated_;
};

TEST_F(ArcTopKMalformedTest, GoodChunksAreAccepted) {
  ASSERT_EQ(plan_.widths, std::vector<uint8_t>({0, 1, 0, 1}));
  for (const auto& bytes : {leaf_, aggregated_}) {
    std::vector<float> out(chunk_.count);
    DQ_EXPECT_OK(codec_->Decompress(plan_, chunk_, bytes, Dst(out, chunk_.begin)));
    DQ_EXPECT_OK(codec_->DecompressAccumulate(plan_, chunk_, bytes, out.data()));
    std::vector<uint8_t> dar(codec_->MaxEncodedBytes(plan_, chunk_));
    DQ_EXPECT_OK(codec_->DecompressAccumulateRecompress(plan_, chunk_, bytes, Src(x_), absl::MakeSpan(dar)));
  }
}

TEST_F(ArcTopKMalformedTest, EveryTruncation) {
  for (const auto& good : {leaf_, aggregated_}) {
    for (size_t n = 0; n < good.size(); ++n) {
      ExpectRejected(std::vector<uint8_t>(good.begin(), good.begin() + n), absl::StatusCode::kDataLoss, "truncated");
    }
  }
}

TEST_F(ArcTopKMalformedTest, BadHeaderFields) {
  for (const auto& good : {leaf_, aggregated_}) {
    auto bad = good;
    bad[0] ^= 0xff;
    ExpectRejected(bad, absl::StatusCode::kInvalidArgument, "magic");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.codec = CodecId::kNone; }),
                   absl::StatusCode::kInvalidArgument, "codec none");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.chunk_id = 9; }), absl::StatusCode::kInvalidArgument,
                   "chunk id 9");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.round = 12; }), absl::StatusCode::kInvalidArgument,
                   "round 12");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.num_elements = 87; }), absl::StatusCode::kInvalidArgument,
                   "87 elements");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.param = 0.25f; }), absl::StatusCode::kInvalidArgument,
                   "density");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.num_summands = kWorld + 1; }),
                   absl::StatusCode::kInvalidArgument, "5 summands");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.flags = 1; }), absl::StatusCode::kInvalidArgument, "flags");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.element_bits = 16; }), absl::StatusCode::kInvalidArgument,
                   "16-bit values");
    auto longer = WithHeader(good, [](ChunkHeader& h) { h.payload_bytes += 4; });
    longer.insert(longer.end(), 4, 0);
    ExpectRejected(longer, absl::StatusCode::kInvalidArgument, "payload");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.payload_bytes -= 4; }), absl::StatusCode::kInvalidArgument,
                   "payload");
  }
}

TEST_F(ArcTopKMalformedTest, ADifferentSelectionIsRejectedBySize) {
  // A receiver that selected other rows (e.g. different statistics) expects another payload size.
  BucketPlan other = plan_;
  other.widths = {0, 1, 1, 1};
  std::vector<float> out(chunk_.count);
  EXPECT_THAT(codec_->Decompress(other, chunk_, leaf_, Dst(out, chunk_.begin)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("payload")));
  other.widths = {0, 1, 0};
  EXPECT_THAT(codec_->Decompress(other, chunk_, leaf_, Dst(out, chunk_.begin)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("plan selects 3 rows of a 4-row bucket")));
}

TEST_F(ArcTopKMalformedTest, DarRejectsCompleteChunkSmallOutputAndBadRefs) {
  auto full = WithHeader(aggregated_, [](ChunkHeader& h) { h.num_summands = kWorld; });
  std::vector<uint8_t> out(codec_->MaxEncodedBytes(plan_, chunk_));
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, full, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already holds all 4")));
  std::vector<uint8_t> small(out.size() - 1, 0x5a);
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, leaf_, Src(x_), absl::MakeSpan(small)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("output buffer")));
  EXPECT_THAT(small, ::testing::Each(0x5a));
  EXPECT_THAT(codec_->Compress(leaf_plan_, ChunkRef{0, 100, 200}, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("256-aligned")));
}

}  // namespace
}  // namespace dynamiq::kernels
