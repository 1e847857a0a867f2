#include "kernels/cpu/flash_codec.h"
#include "tests/kernels/codec_test_util.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_registry.h"
#include "kernels/flash_math.h"
#include "kernels/wire_format.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::StatusIs;
using testing::ExpectChunkRejected;
using testing::Gaussian;
using ::testing::HasSubstr;
using testing::MustCompress;
using testing::MustDar;
using testing::MustDecompress;
using testing::Src;
using testing::WithChunkHeader;

CodecConfig Config(int bits) {
  CodecConfig c;
  c.id = CodecId::kFlash;
  c.bits = bits;
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

// max - min of x over the group that holds bucket element k.
float GroupRange(const std::vector<float>& x, size_t k) {
  const size_t begin = k / kFlashGroupSize * kFlashGroupSize;
  const size_t end = std::min(x.size(), begin + kFlashGroupSize);
  auto [lo, hi] = std::minmax_element(x.begin() + begin, x.begin() + end);
  return *hi - *lo;
}

TEST(FlashCodecTest, FactoryValidatesBitsAndTheRegistryBuildsIt) {
  for (int b = 2; b <= 8; ++b) {
    auto codec = NewFlashCodec(Config(b));
    ASSERT_NE(codec, nullptr) << b;
    EXPECT_EQ(codec->id(), CodecId::kFlash);
  }
  CodecConfig c = Config(4);
  for (double bad : {1.0, 9.0, 4.5, 0.0, -3.0, std::nan("")}) {
    c.bits = bad;
    EXPECT_EQ(NewFlashCodec(c), nullptr) << bad;
  }
  auto made = CreateCodec(Config(8));
  DQ_ASSERT_OK(made);
  EXPECT_THAT((*made)->Describe(), HasSubstr("flash: 8-bit asymmetric round-to-nearest"));
}

TEST(FlashCodecTest, BitsPerCoordinateMeasuredFromBytes) {
  constexpr size_t kN = 128 * 256;
  auto x = Gaussian(kN, 1);
  for (int b = 2; b <= 8; ++b) {
    auto codec = NewFlashCodec(Config(b));
    BucketPlan plan = Plan(kN);
    ChunkRef chunk{0, 0, kN};
    auto bytes = MustCompress(*codec, plan, chunk, Src(x));
    EXPECT_EQ(bytes.size(), codec->MaxEncodedBytes(plan, chunk));
    EXPECT_DOUBLE_EQ(static_cast<double>(bytes.size() - kChunkHeaderBytes) * 8.0 / kN, b + 0.25) << b;
  }
}

TEST(FlashCodecTest, RoundTripWithinHalfAStep) {
  constexpr size_t kN = 1000;  // the last chunk ends in a partial group
  auto x = Gaussian(kN, 2);
  // Per-group ranges from 2^-10 to 2^9, and a group that is all positive (the minimum matters).
  for (size_t i = 0; i < kN; ++i) x[i] *= std::ldexp(1.0f, static_cast<int>(i / 128) * 3 - 10);
  for (size_t i = 256; i < 384; ++i) x[i] = 1000.0f + std::fabs(x[i]);
  for (int b = 2; b <= 8; ++b) {
    auto codec = NewFlashCodec(Config(b));
    const float levels = static_cast<float>(FlashMaxCode(b));
    BucketPlan plan = Plan(kN);
    for (ChunkRef chunk : {ChunkRef{0, 0, 512}, ChunkRef{1, 512, kN - 512}}) {
      auto y = MustDecompress(*codec, plan, chunk, MustCompress(*codec, plan, chunk, Src(x)));
      for (size_t i = 0; i < chunk.count; ++i) {
        const size_t k = chunk.begin + i;
        // Half a step of the bf16 scale (rounded up by < 2^-7, plus the minimum's rounding down),
        // and float rounding of min + code * scale.
        const float step = GroupRange(x, k) / levels * 1.02f + std::fabs(x[k]) * 0.008f / levels;
        ASSERT_LE(std::fabs(y[i] - x[k]), 0.5f * step + std::fabs(x[k]) * 1e-6f) << "b=" << b << " k=" << k;
      }
    }
  }
}

TEST(FlashCodecTest, RoundsToTheNearestCodeDeterministically) {
  // min 0, max 15 at b = 4: scale exactly 1, so 2.4 -> 2, 2.6 -> 3, 7.5 -> 8 (ties up), and every
  // round (and rank) gives the same bytes: the source's rounding has no randomness.
  std::vector<float> x(128, 0.0f);
  x[1] = 15.0f;
  x[2] = 2.4f;
  x[3] = 2.6f;
  x[4] = 7.5f;
  auto codec = NewFlashCodec(Config(4));
  ChunkRef chunk{0, 0, x.size()};
  auto first = MustCompress(*codec, Plan(x.size(), 0), chunk, Src(x));
  auto y = MustDecompress(*codec, Plan(x.size(), 0), chunk, first);
  EXPECT_EQ(y[1], 15.0f);
  EXPECT_EQ(y[2], 2.0f);
  EXPECT_EQ(y[3], 3.0f);
  EXPECT_EQ(y[4], 8.0f);
  for (uint64_t round = 1; round < 5; ++round) {
    auto again = MustCompress(*codec, Plan(x.size(), round, 0, 2), chunk, Src(x));
    // The header carries the round; the payload does not depend on it.
    EXPECT_TRUE(std::equal(first.begin() + kChunkHeaderBytes, first.end(), again.begin() + kChunkHeaderBytes));
  }
}

TEST(FlashCodecTest, ConstantZeroTinyAndHugeGroups) {
  auto codec = NewFlashCodec(Config(8));
  std::vector<float> x(512, 0.0f);
  for (int i = 128; i < 256; ++i) x[i] = -3.25f;  // constant: exact (min is -3.25, scale 0)
  for (int i = 256; i < 384; ++i) x[i] = std::numeric_limits<float>::denorm_min() * static_cast<float>(i);
  for (int i = 384; i < 512; ++i) x[i] = (i % 2 ? 1.0f : -1.0f) * 1.0e38f * (static_cast<float>(i - 383) / 128.0f);
  BucketPlan plan = Plan(x.size());
  ChunkRef chunk{0, 0, x.size()};
  auto y = MustDecompress(*codec, plan, chunk, MustCompress(*codec, plan, chunk, Src(x)));
  for (int i = 0; i < 256; ++i) EXPECT_EQ(y[i], x[i]) << i;
  for (int i = 256; i < 512; ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << i;
    // Subnormal steps are coarse (bf16 subnormal ulp 2^-133); huge ones are normal.
    EXPECT_LE(std::fabs(y[i] - x[i]), i < 384 ? std::ldexp(1.0f, -132) : 2.0e38f / 255.0f) << i;
  }
}

TEST(FlashCodecTest, NonFiniteGroupDecodesToNaNAndSoDoesARangeThatOverflows) {
  auto codec = NewFlashCodec(Config(4));
  auto x = Gaussian(384, 3);
  x[140] = std::numeric_limits<float>::infinity();
  x[300] = 3.0e38f;  // group 2 spans more than float's range: max - min overflows
  x[301] = -3.0e38f;
  BucketPlan plan = Plan(x.size(), 7, 0, 2);
  ChunkRef chunk{0, 0, x.size()};
  auto bytes = MustCompress(*codec, plan, chunk, Src(x));
  for (int g : {1, 2}) {
    const uint8_t* group = bytes.data() + kChunkHeaderBytes + g * FlashGroupBytes(4);
    EXPECT_EQ(FlashLoadHalf(group), kFlashNanMarker) << g;
    EXPECT_EQ(FlashLoadHalf(group + 2), kFlashNanMarker) << g;
  }
  auto y = MustDecompress(*codec, plan, chunk, bytes);
  for (int i = 0; i < 384; ++i) EXPECT_EQ(std::isnan(y[i]), i >= 128) << i;

  // A NaN only in the second rank's local values poisons its group after DAR too.
  auto clean = Gaussian(384, 4);
  auto leaf = MustCompress(*codec, plan, chunk, Src(clean));
  std::vector<float> poisoned = clean;
  poisoned[20] = std::nanf("");
  auto z = MustDecompress(*codec, plan, chunk, MustDar(*codec, Plan(x.size(), 7, 1, 2), chunk, leaf, Src(poisoned)));
  for (int i = 0; i < 384; ++i) EXPECT_EQ(std::isnan(z[i]), i < 128) << i;
}

TEST(FlashCodecTest, DecompressAccumulateAndDarAddPartialSums) {
  auto codec = NewFlashCodec(Config(8));
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
  EXPECT_EQ(header->flags, 0);
  auto y = MustDecompress(*codec, plan1, chunk, sum);
  std::vector<float> total(kN);
  for (size_t k = 0; k < kN; ++k) total[k] = x0[k] + x1[k];
  for (size_t i = 0; i < chunk.count; ++i) {
    const size_t k = chunk.begin + i;
    const float step0 = GroupRange(x0, k) / 255.0f * 1.02f;
    const float step1 = (GroupRange(total, k) + step0) / 255.0f * 1.02f;
    EXPECT_NEAR(y[i], total[k], 0.5f * (step0 + step1) + 1e-6f) << k;
  }
}

TEST(FlashCodecTest, MalformedChunksAreRejectedBeforeAnyOutput) {
  auto codec = NewFlashCodec(Config(4));
  auto x = Gaussian(300, 9);
  BucketPlan plan = Plan(x.size(), 7, 1, 4);
  ChunkRef chunk{0, 0, x.size()};
  auto good = MustCompress(*codec, plan, chunk, Src(x));
  const Source local = Src(x);
  auto group_header = [&](int g, uint16_t min_bits, uint16_t scale_bits) {
    auto bad = good;
    uint8_t* group = bad.data() + kChunkHeaderBytes + g * FlashGroupBytes(4);
    FlashStoreHalf(group, min_bits);
    FlashStoreHalf(group + 2, scale_bits);
    return bad;
  };
  ExpectChunkRejected(*codec, plan, chunk, local, group_header(2, 0x3f80, 0xbf80), absl::StatusCode::kDataLoss,
                      "group 2 has an invalid minimum/scale");  // negative scale
  ExpectChunkRejected(*codec, plan, chunk, local, group_header(1, 0x7f80, 0x3f80), absl::StatusCode::kDataLoss,
                      "invalid minimum/scale");  // Inf minimum
  ExpectChunkRejected(*codec, plan, chunk, local, group_header(0, 0x3f80, kFlashNanMarker), absl::StatusCode::kDataLoss,
                      "invalid minimum/scale");  // half a NaN pair
  ExpectChunkRejected(*codec, plan, chunk, local, group_header(0, 0x7f00, 0x7f00), absl::StatusCode::kDataLoss,
                      "invalid minimum/scale");  // min + 15 * scale overflows
  ExpectChunkRejected(*codec, plan, chunk, local, WithChunkHeader(good, [](ChunkHeader& h) { h.element_bits = 8; }),
                      absl::StatusCode::kInvalidArgument, "8-bit codes, expected 4");
  ExpectChunkRejected(*codec, plan, chunk, local, WithChunkHeader(good, [](ChunkHeader& h) { h.flags = 1; }),
                      absl::StatusCode::kInvalidArgument, "flags");
  ExpectChunkRejected(*codec, plan, chunk, local, WithChunkHeader(good, [](ChunkHeader& h) { h.param = 1.0f; }),
                      absl::StatusCode::kInvalidArgument, "parameter");
  ExpectChunkRejected(*codec, plan, chunk, local, WithChunkHeader(good, [](ChunkHeader& h) { h.num_summands = 5; }),
                      absl::StatusCode::kInvalidArgument, "5 summands in a world of 4");
  ExpectChunkRejected(*codec, plan, chunk, local,
                      WithChunkHeader(good, [](ChunkHeader& h) { h.codec = CodecId::kUniform; }),
                      absl::StatusCode::kInvalidArgument, "");
  auto short_bytes = good;
  short_bytes.resize(short_bytes.size() - 1);
  ExpectChunkRejected(*codec, plan, chunk, local, short_bytes, absl::StatusCode::kDataLoss, "truncated");
  // A chunk off the group grid is the caller's error.
  std::vector<float> out(100);
  EXPECT_THAT(codec->Decompress(plan, ChunkRef{0, 64, 100}, good, testing::Dst(out, 64)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("128-aligned")));
}

}  // namespace
}  // namespace dynamiq::kernels
