#include "kernels/cpu/uniform_codec.h"
#include "tests/kernels/codec_test_util.h"

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
#include "kernels/uniform_math.h"
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

CodecConfig Config(int bits, bool correlated = true) {
  CodecConfig c;
  c.id = CodecId::kUniform;
  c.bits = bits;
  c.correlated_rounding = correlated;
  c.seed = 0x1234567890abcdefull;
  return c;
}

BucketPlan Plan(size_t num_elements, uint64_t round = 7, uint32_t rank = 0, uint32_t world_size = 1) {
  BucketPlan p;
  p.round.round = round;
  p.round.rank = rank;
  p.round.world_size = world_size;
  p.num_elements = num_elements;
  return p;
}

float BlockMax(const std::vector<float>& x, size_t begin, size_t end) {
  float m = 0.0f;
  for (size_t i = begin; i < end; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

TEST(UniformCodecTest, FactoryValidatesBits) {
  for (int b = 2; b <= 8; ++b) {
    auto codec = NewUniformCodec(Config(b));
    ASSERT_NE(codec, nullptr) << b;
    EXPECT_EQ(codec->id(), CodecId::kUniform);
    EXPECT_TRUE(codec->SupportsButterfly());
  }
  CodecConfig c = Config(4);
  for (double bad : {1.0, 9.0, 4.5, 0.0, -3.0, std::nan("")}) {
    c.bits = bad;
    EXPECT_EQ(NewUniformCodec(c), nullptr) << bad;
  }
  c.bits = 4;
  c.id = CodecId::kDynamiq;  // the factory knows which codec it builds
  EXPECT_EQ(NewUniformCodec(c)->id(), CodecId::kUniform);
}

TEST(UniformCodecTest, BitsPerCoordinateMeasuredFromBytes) {
  constexpr size_t kN = 32 * 1024;
  auto x = Gaussian(kN, 1);
  for (int b = 2; b <= 8; ++b) {
    auto codec = NewUniformCodec(Config(b));
    BucketPlan plan = Plan(kN);
    ChunkRef chunk{0, 0, kN};
    auto bytes = MustCompress(*codec, plan, chunk, Src(x));
    EXPECT_EQ(bytes.size(), codec->MaxEncodedBytes(plan, chunk));
    EXPECT_DOUBLE_EQ(static_cast<double>(bytes.size() - kChunkHeaderBytes) * 8.0 / kN, b + 0.5) << b;
    EXPECT_THAT(codec->Describe(), HasSubstr(absl::StrCat(b + 0.5, " bits/coord")));
  }
}

TEST(UniformCodecTest, RoundTripWithinQuantizationGap) {
  constexpr size_t kN = 1000;  // the last chunk ends in a partial block
  auto x = Gaussian(kN, 2);
  for (size_t i = 0; i < kN; ++i) x[i] *= std::ldexp(1.0f, static_cast<int>(i / 32) % 20 - 10);  // per-block ranges
  for (int b = 2; b <= 8; ++b) {
    auto codec = NewUniformCodec(Config(b));
    const float levels = static_cast<float>(UniformMaxLevel(b));
    BucketPlan plan = Plan(kN);
    for (ChunkRef chunk : {ChunkRef{0, 0, 512}, ChunkRef{1, 512, kN - 512}}) {
      auto bytes = MustCompress(*codec, plan, chunk, Src(x));
      auto y = MustDecompress(*codec, plan, chunk, bytes);
      for (size_t i = 0; i < chunk.count; ++i) {
        const size_t k = chunk.begin + i;
        const size_t block_begin = k / 32 * 32;
        const float m = BlockMax(x, block_begin, std::min(kN, block_begin + 32));
        const float gap = m / levels * 1.02f;  // the bf16 scale rounds max / L up by < 2^-7
        ASSERT_LE(std::fabs(y[i] - x[k]), gap) << "b=" << b << " k=" << k;
        ASSERT_LE(std::fabs(y[i]), m * 1.02f);
      }
    }
  }
}

TEST(UniformCodecTest, OnGridInputsAreExactForEveryRound) {
  // b = 4, L = 7: max 1.75 gives the exact bf16 scale 0.25, so multiples of 0.25 are on the grid.
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.25f * static_cast<float>(static_cast<int>(i % 15) - 7);
  auto codec = NewUniformCodec(Config(4));
  for (uint64_t round = 0; round < 50; ++round) {
    BucketPlan plan = Plan(x.size(), round);
    ChunkRef chunk{0, 0, x.size()};
    EXPECT_EQ(MustDecompress(*codec, plan, chunk, MustCompress(*codec, plan, chunk, Src(x))), x);
  }
}

TEST(UniformCodecTest, ZeroTinyAndHugeValues) {
  auto codec = NewUniformCodec(Config(8));
  std::vector<float> x(96, 0.0f);
  for (int i = 32; i < 64; ++i) x[i] = std::numeric_limits<float>::denorm_min() * static_cast<float>(i);
  for (int i = 64; i < 96; ++i) x[i] = (i % 2 ? 1.0f : -1.0f) * 3.0e38f * (static_cast<float>(i - 63) / 32.0f);
  BucketPlan plan = Plan(x.size());
  ChunkRef chunk{0, 0, x.size()};
  auto y = MustDecompress(*codec, plan, chunk, MustCompress(*codec, plan, chunk, Src(x)));
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], 0.0f);
  for (int i = 32; i < 96; ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << i;
    const float m = BlockMax(x, i / 32 * 32, i / 32 * 32 + 32);
    // Subnormal scales are coarse (bf16 subnormal ulp 2^-133), huge ones are normal.
    EXPECT_LE(std::fabs(y[i] - x[i]), i < 64 ? std::ldexp(1.0f, -132) : m / 127.0f * 1.02f) << i;
  }
}

TEST(UniformCodecTest, NonFiniteBlockDecodesToNaN) {
  auto codec = NewUniformCodec(Config(4));
  auto x = Gaussian(96, 3);
  x[40] = std::numeric_limits<float>::infinity();
  BucketPlan plan = Plan(x.size(), 7, 0, 2);
  ChunkRef chunk{0, 0, x.size()};
  auto bytes = MustCompress(*codec, plan, chunk, Src(x));
  const uint8_t* block1 = bytes.data() + kChunkHeaderBytes + UniformBlockBytes(4);
  EXPECT_EQ(UniformLoadScale(block1), kUniformNanScale);
  for (int k = 0; k < 32; ++k) EXPECT_EQ(UniformUnpackCode(block1 + 2, k, 4), 7u);  // code L: zero
  auto y = MustDecompress(*codec, plan, chunk, bytes);
  for (int i = 0; i < 96; ++i) EXPECT_EQ(std::isnan(y[i]), i >= 32 && i < 64) << i;

  // A NaN only in the second rank's local values poisons its block after DAR too.
  auto clean = Gaussian(96, 4);
  auto leaf = MustCompress(*codec, plan, chunk, Src(clean));
  std::vector<float> poisoned = clean;
  poisoned[70] = std::nanf("");
  auto sum = MustDar(*codec, Plan(x.size(), 7, 1, 2), chunk, leaf, Src(poisoned));
  auto z = MustDecompress(*codec, plan, chunk, sum);
  for (int i = 0; i < 96; ++i) EXPECT_EQ(std::isnan(z[i]), i >= 64) << i;
}

TEST(UniformCodecTest, Bf16SourceAndDest) {
  auto codec = NewUniformCodec(Config(8));
  auto x = Gaussian(300, 5);
  std::vector<uint16_t> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = FloatToBf16(x[i]);
  Source src;
  src.data = xb.data();
  src.dtype = DType::kBFloat16;
  BucketPlan plan = Plan(x.size());
  ChunkRef chunk{0, 0, x.size()};
  auto bytes = MustCompress(*codec, plan, chunk, src);
  std::vector<uint16_t> yb(x.size());
  Dest dst;
  dst.data = yb.data();
  dst.dtype = DType::kBFloat16;
  DQ_ASSERT_OK(codec->Decompress(plan, chunk, bytes, dst));
  for (size_t i = 0; i < x.size(); ++i) {
    const float m = BlockMax(x, i / 32 * 32, std::min(x.size(), i / 32 * 32 + 32));
    EXPECT_NEAR(Bf16ToFloat(yb[i]), Bf16ToFloat(xb[i]), m / 127.0f * 1.02f + std::fabs(x[i]) / 128.0f) << i;
  }
}

TEST(UniformCodecTest, DecompressAccumulateAndDarAddPartialSums) {
  auto codec = NewUniformCodec(Config(8));
  constexpr size_t kN = 700;
  auto x0 = Gaussian(kN, 6);
  auto x1 = Gaussian(kN, 7);
  ChunkRef chunk{2, 512, kN - 512};
  BucketPlan plan0 = Plan(kN, 9, 0, 2);
  BucketPlan plan1 = Plan(kN, 9, 1, 2);
  auto leaf = MustCompress(*codec, plan0, chunk, Src(x0));
  auto leaf_decoded = MustDecompress(*codec, plan0, chunk, leaf);

  std::vector<float> acc(chunk.count, 1.0f);
  DQ_ASSERT_OK(codec->DecompressAccumulate(plan1, chunk, leaf, acc.data()));
  for (size_t i = 0; i < chunk.count; ++i) EXPECT_EQ(acc[i], 1.0f + leaf_decoded[i]);

  auto sum = MustDar(*codec, plan1, chunk, leaf, Src(x1));
  auto header = ParseChunkHeader(sum);
  DQ_ASSERT_OK(header);
  EXPECT_EQ(header->num_summands, 2);
  EXPECT_EQ(header->flags, kFlagCorrelated);
  auto y = MustDecompress(*codec, plan1, chunk, sum);
  for (size_t i = 0; i < chunk.count; ++i) {
    const size_t k = chunk.begin + i;
    const size_t b = k / 32 * 32;
    const float gap0 = BlockMax(x0, b, std::min(kN, b + 32)) / 127.0f * 1.02f;
    const float gap1 = (BlockMax(x0, b, std::min(kN, b + 32)) + BlockMax(x1, b, std::min(kN, b + 32))) / 127.0f * 1.03f;
    EXPECT_NEAR(y[i], x0[k] + x1[k], gap0 + gap1) << k;
  }
}

// Mean of decode(encode(x)) - x over K rounds, per coordinate, against 4 sigma / sqrt(K).
struct BiasStats {
  std::vector<double> mean_error;
  std::vector<double> variance;
};

BiasStats Measure(size_t n, int rounds, const std::function<std::vector<float>(int)>& trial,
                  const std::vector<float>& truth) {
  std::vector<double> sum(n, 0.0), sum_sq(n, 0.0);
  for (int r = 0; r < rounds; ++r) {
    auto y = trial(r);
    for (size_t i = 0; i < n; ++i) {
      double e = static_cast<double>(y[i]) - truth[i];
      sum[i] += e;
      sum_sq[i] += e * e;
    }
  }
  BiasStats s;
  for (size_t i = 0; i < n; ++i) {
    double mean = sum[i] / rounds;
    s.mean_error.push_back(mean);
    s.variance.push_back(std::max(0.0, sum_sq[i] / rounds - mean * mean));
  }
  return s;
}

// Coordinates whose mean error exceeds 4 sigma / sqrt(K).
int Biased(const BiasStats& s, int rounds) {
  int biased = 0;
  for (size_t i = 0; i < s.mean_error.size(); ++i) {
    if (std::fabs(s.mean_error[i]) > 4.0 * std::sqrt(s.variance[i] / rounds) + 1e-9) ++biased;
  }
  return biased;
}

TEST(UniformCodecTest, UnbiasedOverRoundsAndVarianceMatchesFormula) {
  constexpr int kRounds = 10000;
  constexpr size_t kN = 64;
  auto codec = NewUniformCodec(Config(3));
  auto x = Gaussian(kN, 8);
  ChunkRef chunk{0, 0, kN};
  BiasStats s = Measure(
      kN, kRounds,
      [&](int r) {
        BucketPlan plan = Plan(kN, static_cast<uint64_t>(r));
        return MustDecompress(*codec, plan, chunk, MustCompress(*codec, plan, chunk, Src(x)));
      },
      x);
  EXPECT_EQ(Biased(s, kRounds), 0);
  // Variance of stochastic rounding: (x_up - x)(x - x_down), summed over coordinates, within 5%.
  double predicted = 0.0, measured = 0.0;
  for (size_t i = 0; i < kN; ++i) {
    const float m = BlockMax(x, i / 32 * 32, i / 32 * 32 + 32);
    uint16_t scale_bits = UniformScaleFor(m, true, UniformMaxLevel(3));
    const double scale = Bf16ToFloat(scale_bits);
    const double t = x[i] / scale;
    predicted += (std::ceil(t) - t) * (t - std::floor(t)) * scale * scale;
    measured += s.variance[i];
  }
  EXPECT_NEAR(measured / predicted, 1.0, 0.05);
}

TEST(UniformCodecTest, BiasCheckCatchesBiasedRounding) {
  // The same statistic on a deliberately biased rounding (u^2 instead of u rounds up too often)
  // must flag coordinates: the bound above has power.
  constexpr int kRounds = 10000;
  constexpr size_t kN = 64;
  auto x = Gaussian(kN, 8);
  const float scale = Bf16ToFloat(UniformScaleFor(BlockMax(x, 0, kN), true, UniformMaxLevel(3)));
  BiasStats s = Measure(
      kN, kRounds,
      [&](int r) {
        std::vector<float> y(kN);
        for (size_t i = 0; i < kN; ++i) {
          float u = BitsToUnit(RandomBits(StreamKey(1, r, 0), i));
          y[i] = (static_cast<float>(UniformQuantize(x[i], scale, 3, u * u)) - 3.0f) * scale;
        }
        return y;
      },
      x);
  EXPECT_GT(Biased(s, kRounds), static_cast<int>(kN) / 2);
}

// A hand-rolled 8-rank ring of identical inputs: Compress on rank 0, DAR on ranks 1..7, decode.
// With `stratify_hops` the hops are (wrongly) named siblings of one stratified group.
BiasStats Ring(bool stratify_hops, int bits, size_t n, int rounds) {
  constexpr uint32_t kRanks = 8;
  auto codec = NewUniformCodec(Config(bits, /*correlated=*/true));
  auto x = Gaussian(n, 12);
  std::vector<float> truth(n);
  for (size_t i = 0; i < n; ++i) truth[i] = kRanks * x[i];
  auto ref = [&](uint32_t rank) {
    ChunkRef chunk{0, 0, n};
    if (stratify_hops) {
      chunk.rounding_index = rank;
      chunk.rounding_size = kRanks;
    }
    return chunk;
  };
  return Measure(
      n, rounds,
      [&](int r) {
        auto bytes = MustCompress(*codec, Plan(n, r, 0, kRanks), ref(0), Src(x));
        for (uint32_t rank = 1; rank < kRanks; ++rank) {
          bytes = MustDar(*codec, Plan(n, r, rank, kRanks), ref(rank), bytes, Src(x));
        }
        return MustDecompress(*codec, Plan(n, r, 0, kRanks), ChunkRef{0, 0, n}, bytes);
      },
      truth);
}

TEST(UniformCodecTest, RingIsUnbiasedWithCorrelatedRoundingConfigured) {
  // A ring has no siblings (rounding_size 1), so every hop rounds independently.
  constexpr int kRounds = 10000;
  EXPECT_EQ(Biased(Ring(/*stratify_hops=*/false, 3, 64, kRounds), kRounds), 0);
}

// Why the codec stratifies only siblings: stratifying successive ring hops (one stratum per rank)
// lowers the variance of the sum by 10-35% but biases it, because hop h's rounding probability
// depends on hop h-1's outcome. This pins the hazard documented in ChunkRef.
TEST(UniformCodecTest, StratifyingRingHopsWouldBeBiased) {
  constexpr int kRounds = 10000;
  BiasStats s = Ring(/*stratify_hops=*/true, 3, 64, kRounds);
  EXPECT_GT(Biased(s, kRounds), 32);
}

// Where the strata belong: 8 siblings rounding the same value on the same scale (8 identical
// leaves summed by one parent, as a butterfly's first level or a parameter server does).
// Stratification pins the number of siblings that round up to floor(8p) or ceil(8p): the sum is
// always within one gap of the truth, and its variance is at most gap^2 / 4 instead of
// 8 p (1 - p) gap^2 (about 1/8 of it on average).
TEST(UniformCodecTest, CorrelatedSiblingsKeepSumWithinOneGap) {
  constexpr uint32_t kRanks = 8;
  constexpr size_t kN = 256;
  constexpr int kRounds = 1000;
  auto x = Gaussian(kN, 11);
  double variance[2];
  for (bool correlated : {false, true}) {
    auto codec = NewUniformCodec(Config(4, correlated));
    std::vector<double> sum(kN, 0.0), sum_sq(kN, 0.0);
    for (int r = 0; r < kRounds; ++r) {
      std::vector<float> acc(kN, 0.0f);
      for (uint32_t rank = 0; rank < kRanks; ++rank) {
        BucketPlan plan = Plan(kN, r, rank, kRanks);
        ChunkRef chunk{0, 0, kN, /*rounding_index=*/rank, /*rounding_size=*/kRanks, /*rounding_group=*/5};
        DQ_ASSERT_OK(codec->DecompressAccumulate(plan, chunk, MustCompress(*codec, plan, chunk, Src(x)), acc.data()));
      }
      for (size_t i = 0; i < kN; ++i) {
        const double e = static_cast<double>(acc[i]) - kRanks * static_cast<double>(x[i]);
        sum[i] += e;
        sum_sq[i] += e * e;
        if (correlated) {
          const float m = BlockMax(x, i / 32 * 32, i / 32 * 32 + 32);
          ASSERT_LE(std::fabs(e), Bf16ToFloat(UniformScaleFor(m, true, UniformMaxLevel(4))) * 1.0001) << i;
        }
      }
    }
    double v = 0.0;
    for (size_t i = 0; i < kN; ++i) v += sum_sq[i] / kRounds - (sum[i] / kRounds) * (sum[i] / kRounds);
    variance[correlated] = v / kN;
  }
  RecordProperty("variance_ratio", std::to_string(variance[1] / variance[0]));
  EXPECT_LT(variance[1], 0.2 * variance[0]) << variance[1] << " vs " << variance[0];
}

// ---- Malformed input: every decoder path must reject it without touching its output.

class UniformMalformedTest : public ::testing::Test {
 protected:
  static constexpr size_t kN = 600;
  UniformMalformedTest()
      : codec_(NewUniformCodec(Config(5))),
        x_(Gaussian(kN, 9)),
        leaf_plan_(Plan(kN, 11, 0, 4)),
        plan_(Plan(kN, 11, 1, 4)),
        chunk_{3, 512, kN - 512},
        good_(MustCompress(*codec_, leaf_plan_, chunk_, Src(x_))) {}

  // Runs Decompress, DecompressAccumulate and DAR on `bytes`; each must fail with `code` and a
  // message containing `substr`, and leave its output untouched.
  void ExpectRejected(const std::vector<uint8_t>& bytes, absl::StatusCode code, const std::string& substr) {
    testing::ExpectChunkRejected(*codec_, plan_, chunk_, Src(x_), bytes, code, substr);
  }

  std::vector<uint8_t> WithHeader(const std::function<void(ChunkHeader&)>& edit) {
    return testing::WithChunkHeader(good_, edit);
  }

  std::unique_ptr<Codec> codec_;
  std::vector<float> x_;
  BucketPlan leaf_plan_;
  BucketPlan plan_;
  ChunkRef chunk_;
  std::vector<uint8_t> good_;
};

TEST_F(UniformMalformedTest, GoodChunkIsAccepted) {
  std::vector<float> out(chunk_.count);
  DQ_EXPECT_OK(codec_->Decompress(plan_, chunk_, good_, Dst(out, chunk_.begin)));
  DQ_EXPECT_OK(codec_->DecompressAccumulate(plan_, chunk_, good_, out.data()));
  std::vector<uint8_t> dar(codec_->MaxEncodedBytes(plan_, chunk_));
  DQ_EXPECT_OK(codec_->DecompressAccumulateRecompress(plan_, chunk_, good_, Src(x_), absl::MakeSpan(dar)));
}

TEST_F(UniformMalformedTest, EveryTruncation) {
  for (size_t n = 0; n < good_.size(); ++n) {
    ExpectRejected(std::vector<uint8_t>(good_.begin(), good_.begin() + n), absl::StatusCode::kDataLoss, "truncated");
  }
}

TEST_F(UniformMalformedTest, BadHeaderFields) {
  auto bad = good_;
  bad[0] ^= 0xff;
  ExpectRejected(bad, absl::StatusCode::kInvalidArgument, "magic");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.codec = CodecId::kMxfp8; }), absl::StatusCode::kInvalidArgument,
                 "codec mxfp8");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.chunk_id = 4; }), absl::StatusCode::kInvalidArgument, "chunk id 4");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.round = 12; }), absl::StatusCode::kInvalidArgument, "round 12");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.num_elements = 87; }), absl::StatusCode::kInvalidArgument,
                 "87 elements");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.num_elements = 0xffffffffu; }), absl::StatusCode::kInvalidArgument,
                 "limit");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.num_elements = kMaxChunkElements; }),
                 absl::StatusCode::kInvalidArgument, "elements, expected 88");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.element_bits = 4; }), absl::StatusCode::kInvalidArgument,
                 "4-bit codes");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.flags = 0; }), absl::StatusCode::kInvalidArgument, "flags");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.num_summands = 5; }), absl::StatusCode::kInvalidArgument,
                 "5 summands");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.param = 1.0f; }), absl::StatusCode::kInvalidArgument, "parameter");
}

TEST_F(UniformMalformedTest, PayloadSizeMismatch) {
  auto longer = WithHeader([](ChunkHeader& h) { h.payload_bytes += 1; });
  longer.push_back(0);
  ExpectRejected(longer, absl::StatusCode::kInvalidArgument, "payload");
  auto shorter = WithHeader([](ChunkHeader& h) { h.payload_bytes -= 1; });
  ExpectRejected(shorter, absl::StatusCode::kInvalidArgument, "payload");
}

TEST_F(UniformMalformedTest, IllegalCode) {
  // Code 31 (2^5 - 1) in every slot position of the last (partial) block, padding included.
  const size_t block = kChunkHeaderBytes + 2 * UniformBlockBytes(5);
  for (int k = 0; k < 32; ++k) {
    auto bad = good_;
    uint8_t* codes = bad.data() + block + 2;
    for (int i = 0; i < 20; ++i) codes[i] = 0;
    UniformPackCode(codes, k, 5, 31);
    ExpectRejected(bad, absl::StatusCode::kDataLoss, "illegal code 31");
  }
}

TEST_F(UniformMalformedTest, BadScales) {
  for (uint16_t scale : {uint16_t{0x7fc1}, uint16_t{0xffc0}, uint16_t{0x7f80}, uint16_t{0xff80}, uint16_t{0xbf80},
                         uint16_t{0x8000}, uint16_t{0x7f7f}}) {
    auto bad = good_;
    bad[kChunkHeaderBytes + UniformBlockBytes(5)] = static_cast<uint8_t>(scale);
    bad[kChunkHeaderBytes + UniformBlockBytes(5) + 1] = static_cast<uint8_t>(scale >> 8);
    ExpectRejected(bad, absl::StatusCode::kDataLoss, "invalid scale");
  }
}

TEST_F(UniformMalformedTest, DarRejectsCompleteChunkAndSmallOutput) {
  auto full = WithHeader([](ChunkHeader& h) { h.num_summands = 4; });
  std::vector<uint8_t> out(codec_->MaxEncodedBytes(plan_, chunk_));
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, full, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already holds all 4")));
  std::vector<uint8_t> small(out.size() - 1, 0x5a);
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, good_, Src(x_), absl::MakeSpan(small)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("output buffer")));
  EXPECT_THAT(small, ::testing::Each(0x5a));
  EXPECT_THAT(codec_->Compress(leaf_plan_, chunk_, Src(x_), absl::MakeSpan(small)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("output buffer")));
}

TEST_F(UniformMalformedTest, BadChunkRefOrPlan) {
  std::vector<uint8_t> out(4096);
  std::vector<float> acc(kN);
  EXPECT_THAT(codec_->Compress(leaf_plan_, ChunkRef{0, 32, 64}, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("256-aligned")));
  EXPECT_THAT(codec_->Compress(leaf_plan_, ChunkRef{0, 512, kN}, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("256-aligned")));
  EXPECT_THAT(codec_->Compress(Plan(kN, 1, 4, 4), chunk_, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 4")));
  EXPECT_THAT(codec_->Compress(leaf_plan_, ChunkRef{3, 512, kN - 512, 4, 4, 0}, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rounding index 4")));
  EXPECT_THAT(codec_->DecompressAccumulate(plan_, ChunkRef{3, 256, 344}, good_, acc.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected 344")));
}

}  // namespace
}  // namespace dynamiq::kernels
