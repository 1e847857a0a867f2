#include "kernels/cpu/global_qsgd_codec.h"
#include "tests/kernels/codec_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_registry.h"
#include "kernels/global_qsgd_math.h"
#include "kernels/wire_format.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::StatusIs;
using testing::Dst;
using testing::Gaussian;
using ::testing::HasSubstr;
using testing::MustCompress;
using testing::MustDar;
using testing::MustDecompress;
using testing::Src;

constexpr uint64_t kSeed = 0x5eed5eed5eed5eedull;

CodecConfig Config(int bits = 8, bool correlated = true) {
  CodecConfig c;
  c.id = CodecId::kGlobalQsgd;
  c.bits = bits;
  c.correlated_rounding = correlated;
  c.seed = kSeed;
  return c;
}

std::unique_ptr<Codec> MustCreate(int bits = 8, bool correlated = true) {
  auto codec = CreateCodec(Config(bits, correlated));
  EXPECT_TRUE(codec.ok()) << codec.status();
  return codec.ok() ? *std::move(codec) : nullptr;
}

// The plan every rank of the round computes: local max |x| reduced with max, then MakePlan.
BucketPlan MustPlan(const Codec& codec, size_t n, uint64_t round, uint32_t rank, uint32_t world_size,
                    const std::vector<const std::vector<float>*>& all_ranks) {
  EXPECT_EQ(codec.StatsLength(n), 1u);
  EXPECT_EQ(codec.stats_reduction(), StatsReduction::kMax);
  float reduced = 0.0f, local = 0.0f;
  for (size_t r = 0; r < all_ranks.size(); ++r) {
    float s = -1.0f;
    codec.ComputeStats(Src(*all_ranks[r]), n, &s);
    reduced = std::max(reduced, s);
    if (r == rank) local = s;
  }
  RoundInfo info{round, rank, world_size};
  auto plan = codec.MakePlan(info, n, absl::MakeConstSpan(&local, 1), absl::MakeConstSpan(&reduced, 1));
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

// A ring along ranks 0..n-1 for one chunk: rank 0 compresses, every later rank runs DAR. Returns
// every message (the last one holds all n contributions).
std::vector<std::vector<uint8_t>> Ring(const Codec& codec, size_t d, uint64_t round, const ChunkRef& chunk,
                                       const std::vector<std::vector<float>>& x) {
  std::vector<const std::vector<float>*> all;
  for (const auto& v : x) all.push_back(&v);
  const uint32_t n = static_cast<uint32_t>(x.size());
  std::vector<std::vector<uint8_t>> messages;
  messages.push_back(MustCompress(codec, MustPlan(codec, d, round, 0, n, all), chunk, Src(x[0])));
  for (uint32_t r = 1; r < n; ++r) {
    messages.push_back(MustDar(codec, MustPlan(codec, d, round, r, n, all), chunk, messages.back(), Src(x[r])));
  }
  return messages;
}

TEST(GlobalQsgdMathTest, LevelsAndSumWidthsGrowOneBitPerDoubling) {
  EXPECT_EQ(GlobalQsgdLevels(2), 1u);
  EXPECT_EQ(GlobalQsgdLevels(4), 7u);
  EXPECT_EQ(GlobalQsgdLevels(8), 127u);
  for (int b = kGlobalQsgdMinBits; b <= kGlobalQsgdMaxBits; ++b) {
    EXPECT_EQ(GlobalQsgdSumBits(1, GlobalQsgdLevels(b)), b) << "a leaf code takes exactly b bits";
  }
  EXPECT_EQ(GlobalQsgdSumBits(2, 127), 9);
  EXPECT_EQ(GlobalQsgdSumBits(3, 127), 10);
  EXPECT_EQ(GlobalQsgdSumBits(4, 127), 10);
  EXPECT_EQ(GlobalQsgdSumBits(5, 127), 11);
  EXPECT_EQ(GlobalQsgdSumBits(8, 127), 11);
  EXPECT_EQ(GlobalQsgdSumBits(9, 127), 12);
  EXPECT_EQ(GlobalQsgdSumBits(65535, 127), kGlobalQsgdMaxSumBits);
  EXPECT_EQ(GlobalQsgdPackedBytes(3, 9), 4u);
}

TEST(GlobalQsgdMathTest, PackUnpackEveryWidth) {
  std::mt19937 rng(3);
  for (int w = 2; w <= kGlobalQsgdMaxSumBits; ++w) {
    const size_t n = 301;
    std::vector<uint32_t> codes(n);
    for (uint32_t& c : codes) c = rng() & ((1u << w) - 1u);
    std::vector<uint8_t> packed(GlobalQsgdPackedBytes(n, w), 0);
    for (size_t j = 0; j < n; ++j) GlobalQsgdPack(packed.data(), j, w, codes[j]);
    for (size_t j = 0; j < n; ++j) ASSERT_EQ(GlobalQsgdUnpack(packed.data(), j, w), codes[j]) << w << " " << j;
    // The sequential writer produces the same bytes, the reader the same codes.
    std::vector<uint8_t> written(packed.size(), 0xee);
    GlobalQsgdBitWriter writer(written.data());
    for (uint32_t c : codes) writer.Put(c, w);
    writer.Flush();
    EXPECT_EQ(writer.p, written.data() + written.size());
    EXPECT_EQ(written, packed) << w;
    GlobalQsgdBitReader reader(packed.data());
    for (size_t j = 0; j < n; ++j) ASSERT_EQ(reader.Next(w), codes[j]) << w << " " << j;
    EXPECT_LE(reader.p, packed.data() + packed.size());
  }
}

TEST(GlobalQsgdMathTest, QuantizeIsUnbiasedBetweenNeighbours) {
  // t = 2.25 levels: up with probability 1/4.
  EXPECT_EQ(GlobalQsgdQuantize(2.25f, 1.0f, 7, 0.24f), 3);
  EXPECT_EQ(GlobalQsgdQuantize(2.25f, 1.0f, 7, 0.26f), 2);
  EXPECT_EQ(GlobalQsgdQuantize(-2.25f, 1.0f, 7, 0.74f), -2);
  EXPECT_EQ(GlobalQsgdQuantize(-2.25f, 1.0f, 7, 0.76f), -3);
  EXPECT_EQ(GlobalQsgdQuantize(100.0f, 1.0f, 7, 0.0f), 7);  // clamped to s
  EXPECT_EQ(GlobalQsgdQuantize(-1e30f, 1.0f, 7, 0.5f), -7);
  EXPECT_EQ(GlobalQsgdQuantize(0.0f, 0.0f, 7, 0.0f), 0);  // M = 0
}

TEST(GlobalQsgdCodecTest, RegisteredInTheCodecTable) {
  EXPECT_THAT(ParseCodecId("global_qsgd"), ::dynamiq::testing::IsOkAndHolds(CodecId::kGlobalQsgd));
  EXPECT_EQ(static_cast<int>(CodecId::kGlobalQsgd), 9);  // part of the wire format
  const CodecInfo& info = GetCodecInfo(CodecId::kGlobalQsgd);
  EXPECT_TRUE(info.has_bits);
  EXPECT_EQ(info.default_bits, 8);
  EXPECT_FALSE(info.on_cuda);
  EXPECT_THAT(CreateCodec(Config(1)).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2..8")));
  EXPECT_THAT(CreateCodec(Config(9)).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2..8")));
  CodecConfig half = Config();
  half.bits = 4.5;
  EXPECT_THAT(CreateCodec(half).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("integer")));
  EXPECT_EQ(NewGlobalQsgdCodec(half), nullptr);
  auto codec = MustCreate(4);
  EXPECT_EQ(codec->id(), CodecId::kGlobalQsgd);
  EXPECT_FALSE(codec->SupportsButterfly());
  EXPECT_THAT(codec->Describe(), HasSubstr("7 levels per sign"));
}

TEST(GlobalQsgdCodecTest, StatsAreTheMaxAbsAndPlanRefusesNonFinite) {
  auto codec = MustCreate();
  std::vector<float> x = {0.5f, -3.0f, 2.0f};
  float s = 0;
  codec->ComputeStats(Src(x), x.size(), &s);
  EXPECT_EQ(s, 3.0f);
  x[1] = std::nanf("");
  codec->ComputeStats(Src(x), x.size(), &s);
  EXPECT_TRUE(std::isinf(s)) << "a NaN must not vanish in the max";
  const float local = 1.0f;
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf(""), -1.0f}) {
    EXPECT_THAT(
        codec->MakePlan(RoundInfo{1, 0, 2}, 3, absl::MakeConstSpan(&local, 1), absl::MakeConstSpan(&bad, 1)).status(),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("global scale")));
  }
  EXPECT_THAT(codec->MakePlan(RoundInfo{1, 0, 2}, 3, {}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 1")));
  EXPECT_THAT(codec->MakePlan(RoundInfo{1, 0, 70000}, 3, absl::MakeConstSpan(&local, 1), absl::MakeConstSpan(&local, 1))
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("65535")));
}

TEST(GlobalQsgdCodecTest, LeafIsBBitsPerCoordinateAndWithinOneLevel) {
  const size_t n = 1000;
  auto x = Gaussian(n, 1);
  for (int bits : {2, 4, 8}) {
    auto codec = MustCreate(bits);
    const BucketPlan plan = MustPlan(*codec, n, 5, 0, 1, {&x});
    const ChunkRef chunk{0, 0, n};
    auto bytes = MustCompress(*codec, plan, chunk, Src(x));
    EXPECT_EQ(bytes.size(), kChunkHeaderBytes + (n * bits + 7) / 8);
    const auto h = ParseChunkHeader(bytes);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(h->element_bits, bits);
    EXPECT_EQ(h->param, plan.global_scale);
    const float unit = plan.global_scale / GlobalQsgdLevels(bits);
    auto y = MustDecompress(*codec, plan, chunk, bytes);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_LT(std::fabs(y[i] - x[i]), unit * 1.0001f) << bits << " " << i;
      const float level = y[i] / unit;
      ASSERT_NEAR(level, std::round(level), 1e-3) << "decoded values are multiples of M / s";
    }
  }
}

TEST(GlobalQsgdCodecTest, RingSumsIntegersExactlyAndWidensPerHop) {
  // The ring's final message decodes to exactly the sum of what each rank's own leaf encoding of
  // its values decodes to: hops add integers, they never re-quantize.
  const size_t d = 777;
  const uint32_t n = 8;
  const ChunkRef chunk{2, 256, 500};
  std::vector<std::vector<float>> x;
  for (uint32_t r = 0; r < n; ++r) x.push_back(Gaussian(d, 100 + r, 1.0f + r));
  std::vector<const std::vector<float>*> all;
  for (const auto& v : x) all.push_back(&v);
  for (bool correlated : {false, true}) {
    auto codec = MustCreate(8, correlated);
    auto messages = Ring(*codec, d, 9, chunk, x);
    for (uint32_t k = 1; k <= n; ++k) {
      const auto h = ParseChunkHeader(messages[k - 1]);
      ASSERT_TRUE(h.ok());
      EXPECT_EQ(h->num_summands, k);
      EXPECT_EQ(h->element_bits, GlobalQsgdSumBits(k, 127));
      EXPECT_EQ(h->flags, correlated ? kFlagCorrelated : 0);
    }
    const BucketPlan sink = MustPlan(*codec, d, 9, 1, n, all);
    auto sum = MustDecompress(*codec, sink, chunk, messages.back());
    std::vector<double> expected(chunk.count, 0.0);
    for (uint32_t r = 0; r < n; ++r) {
      const BucketPlan plan = MustPlan(*codec, d, 9, r, n, all);
      auto own = MustDecompress(*codec, plan, chunk, MustCompress(*codec, plan, chunk, Src(x[r])));
      for (size_t i = 0; i < chunk.count; ++i) expected[i] += own[i];
    }
    const float unit = sink.global_scale / 127;
    for (size_t i = 0; i < chunk.count; ++i) {
      // Both are integers times the unit; float rounding of the per-rank sum is the only slack.
      ASSERT_NEAR(sum[i], expected[i], unit * 1e-3) << i;
    }
  }
}

TEST(GlobalQsgdCodecTest, RingIsUnbiasedOverRounds) {
  const size_t d = 512;
  const uint32_t n = 4;
  const ChunkRef chunk{0, 0, d};
  std::vector<std::vector<float>> x;
  for (uint32_t r = 0; r < n; ++r) x.push_back(Gaussian(d, 7 + r));
  std::vector<double> exact(d, 0.0);
  for (const auto& v : x) {
    for (size_t i = 0; i < d; ++i) exact[i] += v[i];
  }
  for (bool correlated : {false, true}) {
    auto codec = MustCreate(2, correlated);  // ternary: the coarsest, where bias would show
    std::vector<const std::vector<float>*> all;
    for (const auto& v : x) all.push_back(&v);
    const int rounds = 400;
    std::vector<double> mean(d, 0.0);
    float m = 0;
    for (int t = 0; t < rounds; ++t) {
      auto messages = Ring(*codec, d, 1000 + t, chunk, x);
      const BucketPlan sink = MustPlan(*codec, d, 1000 + t, 0, n, all);
      m = sink.global_scale;
      auto y = MustDecompress(*codec, sink, chunk, messages.back());
      for (size_t i = 0; i < d; ++i) mean[i] += y[i] / rounds;
    }
    // Per element the sum's variance is at most n * M^2 / 4 per round (unit = M at s = 1).
    const double tolerance = 5.0 * std::sqrt(n * m * m / 4.0 / rounds);
    int outside = 0;
    for (size_t i = 0; i < d; ++i) outside += std::fabs(mean[i] - exact[i]) > tolerance;
    EXPECT_LE(outside, 1) << "correlated " << correlated;
  }
}

TEST(GlobalQsgdCodecTest, ZeroBucketAndBf16Input) {
  auto codec = MustCreate(4);
  std::vector<float> zero(300, 0.0f);
  const BucketPlan plan = MustPlan(*codec, zero.size(), 1, 0, 1, {&zero});
  EXPECT_EQ(plan.global_scale, 0.0f);
  const ChunkRef chunk{0, 0, zero.size()};
  auto y = MustDecompress(*codec, plan, chunk, MustCompress(*codec, plan, chunk, Src(zero)));
  EXPECT_THAT(y, ::testing::Each(0.0f));

  // bf16 local values quantize like their fp32 widening.
  auto x = Gaussian(300, 4);
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    b[i] = FloatToBf16(x[i]);
    x[i] = Bf16ToFloat(b[i]);
  }
  Source sb;
  sb.data = b.data();
  sb.dtype = DType::kBFloat16;
  const BucketPlan p2 = MustPlan(*codec, x.size(), 1, 0, 1, {&x});
  EXPECT_EQ(MustCompress(*codec, p2, chunk, sb), MustCompress(*codec, p2, chunk, Src(x)));
}

TEST(GlobalQsgdCodecTest, NonFiniteLocalValuesAreRejected) {
  auto codec = MustCreate();
  auto x = Gaussian(300, 2);
  const BucketPlan plan = MustPlan(*codec, x.size(), 1, 0, 2, {&x});
  x[17] = std::numeric_limits<float>::infinity();
  const ChunkRef chunk{0, 0, x.size()};
  std::vector<uint8_t> out(codec->MaxEncodedBytes(plan, chunk));
  EXPECT_THAT(codec->Compress(plan, chunk, Src(x), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Inf/NaN")));
}

TEST(GlobalQsgdCodecTest, DecodingTheSameBytesIsBitIdenticalAcrossRanks) {
  const size_t d = 600;
  const uint32_t n = 4;
  std::vector<std::vector<float>> x;
  for (uint32_t r = 0; r < n; ++r) x.push_back(Gaussian(d, 40 + r, 3.0f));
  std::vector<const std::vector<float>*> all;
  for (const auto& v : x) all.push_back(&v);
  auto codec = MustCreate(5);
  const ChunkRef chunk{1, 0, d};
  auto messages = Ring(*codec, d, 3, chunk, x);
  std::vector<float> first;
  for (uint32_t r = 0; r < n; ++r) {
    auto y = MustDecompress(*codec, MustPlan(*codec, d, 3, r, n, all), chunk, messages.back());
    if (r == 0) {
      first = y;
    } else {
      ASSERT_EQ(0, std::memcmp(first.data(), y.data(), d * sizeof(float))) << "rank " << r;
    }
  }
}

class GlobalQsgdMalformedTest : public ::testing::Test {
 protected:
  static constexpr size_t kN = 600;
  static constexpr uint32_t kWorld = 8;
  GlobalQsgdMalformedTest() : codec_(MustCreate(8)), x_(Gaussian(kN, 10)), chunk_{3, 512, kN - 512} {
    leaf_plan_ = MustPlan(*codec_, kN, 11, 0, kWorld, {&x_});
    mid_plan_ = MustPlan(*codec_, kN, 11, 1, kWorld, {&x_});
    plan_ = MustPlan(*codec_, kN, 11, 2, kWorld, {&x_});
    leaf_ = MustCompress(*codec_, leaf_plan_, chunk_, Src(x_));
    aggregated_ = MustDar(*codec_, mid_plan_, chunk_, leaf_, Src(x_));
  }

  // Runs Decompress, DecompressAccumulate and DAR (as rank 2) on `bytes`; each must fail with
  // `code` and a message containing `substr`, and leave its output untouched.
  void ExpectRejected(const std::vector<uint8_t>& bytes, absl::StatusCode code, const std::string& substr) {
    testing::ExpectChunkRejected(*codec_, plan_, chunk_, Src(x_), bytes, code, substr);
  }

  static std::vector<uint8_t> WithHeader(std::vector<uint8_t> bytes, const std::function<void(ChunkHeader&)>& edit) {
    return testing::WithChunkHeader(std::move(bytes), edit);
  }

  std::unique_ptr<Codec> codec_;
  std::vector<float> x_;
  ChunkRef chunk_;
  BucketPlan leaf_plan_, mid_plan_, plan_;
  std::vector<uint8_t> leaf_, aggregated_;
};

TEST_F(GlobalQsgdMalformedTest, GoodChunksAreAccepted) {
  for (const auto& bytes : {leaf_, aggregated_}) {
    std::vector<float> out(chunk_.count);
    DQ_EXPECT_OK(codec_->Decompress(plan_, chunk_, bytes, Dst(out, chunk_.begin)));
    DQ_EXPECT_OK(codec_->DecompressAccumulate(plan_, chunk_, bytes, out.data()));
    std::vector<uint8_t> dar(codec_->MaxEncodedBytes(plan_, chunk_));
    DQ_EXPECT_OK(codec_->DecompressAccumulateRecompress(plan_, chunk_, bytes, Src(x_), absl::MakeSpan(dar)));
  }
}

TEST_F(GlobalQsgdMalformedTest, EveryTruncation) {
  for (const auto& good : {leaf_, aggregated_}) {
    for (size_t n = 0; n < good.size(); ++n) {
      ExpectRejected(std::vector<uint8_t>(good.begin(), good.begin() + n), absl::StatusCode::kDataLoss, "truncated");
    }
  }
}

TEST_F(GlobalQsgdMalformedTest, BadHeaderFields) {
  for (const auto& good : {leaf_, aggregated_}) {
    auto bad = good;
    bad[0] ^= 0xff;
    ExpectRejected(bad, absl::StatusCode::kInvalidArgument, "magic");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.codec = CodecId::kThc; }),
                   absl::StatusCode::kInvalidArgument, "codec thc");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.chunk_id = 9; }), absl::StatusCode::kInvalidArgument,
                   "chunk id 9");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.round = 12; }), absl::StatusCode::kInvalidArgument,
                   "round 12");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.num_elements = 87; }), absl::StatusCode::kInvalidArgument,
                   "87 elements");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.num_elements = 0xffffffffu; }),
                   absl::StatusCode::kInvalidArgument, "limit");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.param *= 1.5f; }), absl::StatusCode::kInvalidArgument,
                   "global scale");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.num_summands = kWorld + 1; }),
                   absl::StatusCode::kInvalidArgument, "9 summands");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.flags &= ~kFlagCorrelated; }),
                   absl::StatusCode::kInvalidArgument, "flags");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.flags |= 0x80; }), absl::StatusCode::kInvalidArgument,
                   "flags");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.element_bits = 16; }), absl::StatusCode::kInvalidArgument,
                   "16-bit codes");
    auto longer = WithHeader(good, [](ChunkHeader& h) { h.payload_bytes += 1; });
    longer.push_back(0);
    ExpectRejected(longer, absl::StatusCode::kInvalidArgument, "payload");
    ExpectRejected(WithHeader(good, [](ChunkHeader& h) { h.payload_bytes -= 1; }), absl::StatusCode::kInvalidArgument,
                   "payload");
  }
  ExpectRejected(WithHeader(leaf_, [](ChunkHeader& h) { h.param = std::nanf(""); }), absl::StatusCode::kInvalidArgument,
                 "not finite");
  // The summand count fixes the width, hence the payload size.
  ExpectRejected(WithHeader(leaf_, [](ChunkHeader& h) { h.num_summands = 2; }), absl::StatusCode::kInvalidArgument,
                 "payload");
  ExpectRejected(WithHeader(aggregated_, [](ChunkHeader& h) { h.num_summands = 1; }),
                 absl::StatusCode::kInvalidArgument, "payload");
}

TEST_F(GlobalQsgdMalformedTest, StoredValueOutOfRange) {
  // Leaf (8 bits, s = 127): 0..254 legal, 255 not. Two summands (9 bits): 0..508 legal.
  struct Case {
    std::vector<uint8_t>* bytes;
    int w;
    uint32_t max_legal;
  };
  for (const Case& c : {Case{&leaf_, 8, 254}, Case{&aggregated_, 9, 508}}) {
    for (size_t j : {size_t{0}, size_t{44}, chunk_.count - 1}) {
      auto put = [&](uint32_t v) {
        std::vector<uint8_t> bytes = *c.bytes;
        uint8_t* q = bytes.data() + kChunkHeaderBytes;
        for (int b = 0; b < c.w; ++b) {
          const size_t bit = j * c.w + b;
          q[bit / 8] &= static_cast<uint8_t>(~(1u << (bit % 8)));
        }
        GlobalQsgdPack(q, j, c.w, v);
        return bytes;
      };
      std::vector<float> out(chunk_.count);
      DQ_EXPECT_OK(codec_->Decompress(plan_, chunk_, put(c.max_legal), Dst(out, chunk_.begin)));
      ExpectRejected(put(c.max_legal + 1), absl::StatusCode::kDataLoss, absl::StrCat("holds ", c.max_legal + 1));
      ExpectRejected(put((1u << c.w) - 1), absl::StatusCode::kDataLoss, "more than 2 x");
    }
  }
}

TEST_F(GlobalQsgdMalformedTest, DarRejectsCompleteChunkSmallOutputAndBadPlans) {
  auto full = leaf_;
  for (uint32_t r = 1; r < kWorld; ++r)
    full = MustDar(*codec_, MustPlan(*codec_, kN, 11, r, kWorld, {&x_}), chunk_, full, Src(x_));
  std::vector<uint8_t> out(codec_->MaxEncodedBytes(plan_, chunk_));
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, full, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already holds all 8")));
  std::vector<uint8_t> small(aggregated_.size() + 1, 0x5a);  // DAR of 2 summands needs 10 bits
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, aggregated_, Src(x_), absl::MakeSpan(small)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("output buffer")));
  EXPECT_THAT(small, ::testing::Each(0x5a));
  std::vector<uint8_t> tiny(leaf_.size() - 1);
  EXPECT_THAT(codec_->Compress(leaf_plan_, chunk_, Src(x_), absl::MakeSpan(tiny)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("output buffer")));
  EXPECT_THAT(codec_->Compress(leaf_plan_, ChunkRef{0, 500, 200}, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not inside")));
  BucketPlan nan_plan = leaf_plan_;
  nan_plan.global_scale = std::nanf("");
  EXPECT_THAT(codec_->Compress(nan_plan, chunk_, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("global scale")));
  BucketPlan other = plan_;
  other.global_scale *= 2.0f;
  std::vector<float> acc(chunk_.count);
  EXPECT_THAT(codec_->DecompressAccumulate(other, chunk_, leaf_, acc.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("global scale")));
}

}  // namespace
}  // namespace dynamiq::kernels
