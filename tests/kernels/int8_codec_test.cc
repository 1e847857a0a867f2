#include "kernels/cpu/int8_codec.h"
#include "tests/kernels/codec_test_util.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "kernels/int8_math.h"
#include "kernels/random_math.h"
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

CodecConfig Config() {
  CodecConfig c;
  c.id = CodecId::kInt8;
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

float ScaleOf(const std::vector<uint8_t>& bytes) {
  uint32_t bits = 0;
  std::memcpy(&bits, bytes.data() + kChunkHeaderBytes, 4);
  return BitsToFloat(bits);
}

TEST(Int8CodecTest, RegisteredInTheCodecTable) {
  auto id = ParseCodecId("int8");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, CodecId::kInt8);
  EXPECT_FALSE(GetCodecInfo(CodecId::kInt8).has_bits);
  EXPECT_FALSE(GetCodecInfo(CodecId::kInt8).on_cuda);
  auto codec = CreateCodec(Config());
  ASSERT_TRUE(codec.ok()) << codec.status();
  EXPECT_EQ((*codec)->id(), CodecId::kInt8);
  EXPECT_THAT((*codec)->Describe(), HasSubstr("clip at +-6 sigma"));
}

TEST(Int8CodecTest, EightBitsPerCoordinatePlusScale) {
  constexpr size_t kN = 10000;
  auto codec = NewInt8Codec(Config());
  auto x = Gaussian(kN, 1);
  auto bytes = MustCompress(*codec, Plan(kN), ChunkRef{0, 0, kN}, Src(x));
  EXPECT_EQ(bytes.size(), kChunkHeaderBytes + 4 + kN);
}

TEST(Int8CodecTest, RoundTripWithinOneStepAndClipsAtSixSigma) {
  constexpr size_t kN = 4096;
  auto codec = NewInt8Codec(Config());
  auto x = Gaussian(kN, 2, 3.0f);
  x[17] = 1000.0f;  // far beyond 6 sigma: clipped
  ChunkRef chunk{0, 0, kN};
  auto bytes = MustCompress(*codec, Plan(kN), chunk, Src(x));
  double sum_sq = 0;
  for (float v : x) sum_sq += static_cast<double>(v) * v;
  const float scale = ScaleOf(bytes);
  EXPECT_FLOAT_EQ(scale, static_cast<float>(6.0 * std::sqrt(sum_sq / kN) / 127.0));
  auto y = MustDecompress(*codec, Plan(kN), chunk, bytes);
  const float clip = 127.0f * scale;
  for (size_t i = 0; i < kN; ++i) {
    const float clipped = std::fmin(std::fmax(x[i], -clip), clip);
    EXPECT_LE(std::fabs(y[i] - clipped), scale * 1.0001f) << i;
  }
  EXPECT_FLOAT_EQ(y[17], clip);
}

TEST(Int8CodecTest, ZeroAndNonFiniteChunks) {
  constexpr size_t kN = 300;
  auto codec = NewInt8Codec(Config());
  ChunkRef chunk{0, 0, kN};
  std::vector<float> zeros(kN, 0.0f);
  auto y = MustDecompress(*codec, Plan(kN), chunk, MustCompress(*codec, Plan(kN), chunk, Src(zeros)));
  EXPECT_THAT(y, ::testing::Each(0.0f));
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    auto x = Gaussian(kN, 3);
    x[100] = bad;
    auto z = MustDecompress(*codec, Plan(kN), chunk, MustCompress(*codec, Plan(kN), chunk, Src(x)));
    for (float v : z) EXPECT_TRUE(std::isnan(v));
  }
}

// A hand-rolled ring of `ranks` ranks: Compress on rank 0, DAR on the others, decode. Returns the
// mean error per coordinate over `rounds` rounds and its variance.
void RingBias(int ranks, size_t n, int rounds, std::vector<double>* mean, std::vector<double>* var) {
  auto codec = NewInt8Codec(Config());
  std::vector<std::vector<float>> inputs;
  std::vector<double> exact(n, 0.0);
  for (int r = 0; r < ranks; ++r) {
    inputs.push_back(Gaussian(n, 100 + r));
    for (size_t i = 0; i < n; ++i) exact[i] += inputs[r][i];
  }
  ChunkRef chunk{0, 0, n};
  std::vector<double> sum(n, 0.0), sum_sq(n, 0.0);
  for (int k = 0; k < rounds; ++k) {
    auto bytes = MustCompress(*codec, Plan(n, k, 0, ranks), chunk, Src(inputs[0]));
    for (int r = 1; r < ranks; ++r) bytes = MustDar(*codec, Plan(n, k, r, ranks), chunk, bytes, Src(inputs[r]));
    auto y = MustDecompress(*codec, Plan(n, k, 0, ranks), chunk, bytes);
    for (size_t i = 0; i < n; ++i) {
      const double e = y[i] - exact[i];
      sum[i] += e;
      sum_sq[i] += e * e;
    }
  }
  mean->assign(n, 0.0);
  var->assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    (*mean)[i] = sum[i] / rounds;
    (*var)[i] = sum_sq[i] / rounds - (*mean)[i] * (*mean)[i];
  }
}

TEST(Int8CodecTest, RingIsUnbiasedWithinTheClip) {
  // Gaussian inputs: nothing reaches 6 sigma of the partial sums, so every hop is unbiased.
  constexpr int kRounds = 4000;
  constexpr size_t kN = 256;
  std::vector<double> mean, var;
  RingBias(4, kN, kRounds, &mean, &var);
  int biased = 0;
  double total_var = 0;
  for (size_t i = 0; i < kN; ++i) {
    if (std::fabs(mean[i]) > 4.0 * std::sqrt(var[i] / kRounds) + 1e-9) ++biased;
    total_var += var[i];
  }
  EXPECT_EQ(biased, 0);
  // Error per coordinate: at most 3 re-quantizations of step <= 6 * 2 / 127 (sigma of a 4-rank sum
  // of unit Gaussians is 2): variance <= 3 * step^2 / 4.
  const double step = 6.0 * 2.0 * 1.2 / 127.0;
  EXPECT_GT(total_var / kN, 0.0);
  EXPECT_LT(total_var / kN, 3 * step * step / 4);
}

TEST(Int8CodecTest, DecodingTheSameBytesIsBitIdenticalAcrossRanks) {
  constexpr size_t kN = 1000;
  auto codec = NewInt8Codec(Config());
  auto x = Gaussian(kN, 4);
  ChunkRef chunk{2, 0, kN};
  auto bytes = MustCompress(*codec, Plan(kN, 3, 1, 4), chunk, Src(x));
  auto a = MustDecompress(*codec, Plan(kN, 3, 0, 4), chunk, bytes);
  auto b = MustDecompress(*codec, Plan(kN, 3, 3, 4), chunk, bytes);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), kN * sizeof(float)));
  // And compression is deterministic: the same (seed, round, rank) gives the same bytes.
  EXPECT_EQ(bytes, MustCompress(*codec, Plan(kN, 3, 1, 4), chunk, Src(x)));
  EXPECT_NE(bytes, MustCompress(*codec, Plan(kN, 4, 1, 4), chunk, Src(x)));
}

class Int8MalformedTest : public ::testing::Test {
 protected:
  static constexpr size_t kN = 600;
  Int8MalformedTest()
      : codec_(NewInt8Codec(Config())),
        x_(Gaussian(kN, 9)),
        leaf_plan_(Plan(kN, 11, 0, 4)),
        plan_(Plan(kN, 11, 1, 4)),
        chunk_{3, 512, kN - 512},
        good_(MustCompress(*codec_, leaf_plan_, chunk_, Src(x_))) {}

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

TEST_F(Int8MalformedTest, GoodChunkIsAccepted) {
  std::vector<float> out(chunk_.count);
  DQ_EXPECT_OK(codec_->Decompress(plan_, chunk_, good_, Dst(out, chunk_.begin)));
  DQ_EXPECT_OK(codec_->DecompressAccumulate(plan_, chunk_, good_, out.data()));
  std::vector<uint8_t> dar(codec_->MaxEncodedBytes(plan_, chunk_));
  DQ_EXPECT_OK(codec_->DecompressAccumulateRecompress(plan_, chunk_, good_, Src(x_), absl::MakeSpan(dar)));
}

TEST_F(Int8MalformedTest, EveryTruncation) {
  for (size_t n = 0; n < good_.size(); ++n) {
    ExpectRejected(std::vector<uint8_t>(good_.begin(), good_.begin() + n), absl::StatusCode::kDataLoss, "truncated");
  }
}

TEST_F(Int8MalformedTest, BadHeaderFields) {
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.codec = CodecId::kUniform; }), absl::StatusCode::kInvalidArgument,
                 "codec uniform");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.chunk_id = 4; }), absl::StatusCode::kInvalidArgument, "chunk id 4");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.round = 12; }), absl::StatusCode::kInvalidArgument, "round 12");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.num_elements = 87; }), absl::StatusCode::kInvalidArgument,
                 "87 elements");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.element_bits = 4; }), absl::StatusCode::kInvalidArgument,
                 "4-bit codes");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.flags = 1; }), absl::StatusCode::kInvalidArgument, "flags");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.num_summands = 5; }), absl::StatusCode::kInvalidArgument,
                 "5 summands");
  ExpectRejected(WithHeader([](ChunkHeader& h) { h.param = 4.0f; }), absl::StatusCode::kInvalidArgument, "parameter");
}

TEST_F(Int8MalformedTest, PayloadSizeMismatch) {
  auto longer = WithHeader([](ChunkHeader& h) { h.payload_bytes += 1; });
  longer.push_back(0);
  ExpectRejected(longer, absl::StatusCode::kInvalidArgument, "payload");
  auto shorter = WithHeader([](ChunkHeader& h) { h.payload_bytes -= 1; });
  ExpectRejected(shorter, absl::StatusCode::kInvalidArgument, "payload");
}

TEST_F(Int8MalformedTest, IllegalCodeAnywhere) {
  for (size_t k : {size_t{0}, size_t{1}, chunk_.count / 2, chunk_.count - 1}) {
    auto bad = good_;
    bad[kChunkHeaderBytes + 4 + k] = 255;
    ExpectRejected(bad, absl::StatusCode::kDataLoss, "illegal code 255");
  }
}

TEST_F(Int8MalformedTest, BadScales) {
  for (uint32_t scale : {0x7fc00001u, 0xffc00000u, 0x7f800000u, 0xff800000u, 0xbf800000u, 0x80000000u, 0x7f7fffffu}) {
    auto bad = good_;
    std::memcpy(bad.data() + kChunkHeaderBytes, &scale, 4);
    ExpectRejected(bad, absl::StatusCode::kDataLoss, "invalid scale");
  }
}

TEST_F(Int8MalformedTest, DarRejectsCompleteChunkSmallOutputAndBadRefs) {
  auto full = WithHeader([](ChunkHeader& h) { h.num_summands = 4; });
  std::vector<uint8_t> out(codec_->MaxEncodedBytes(plan_, chunk_));
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, full, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already holds all 4")));
  std::vector<uint8_t> small(out.size() - 1, 0x5a);
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, good_, Src(x_), absl::MakeSpan(small)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("output buffer")));
  EXPECT_THAT(small, ::testing::Each(0x5a));
  EXPECT_THAT(codec_->Compress(leaf_plan_, ChunkRef{0, 512, kN}, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not inside")));
  EXPECT_THAT(codec_->Compress(Plan(kN, 1, 4, 4), chunk_, Src(x_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 4")));
}

}  // namespace
}  // namespace dynamiq::kernels
