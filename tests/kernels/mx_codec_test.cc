#include "kernels/cpu/mx_codec.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/bf16_math.h"
#include "kernels/mx_math.h"
#include "kernels/wire_format.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr MxElementFormat kE4M3 = MxFormatForBits(8);
constexpr MxElementFormat kE3M2 = MxFormatForBits(6);
constexpr MxElementFormat kE2M1 = MxFormatForBits(4);
constexpr CodecId kMxIds[] = {CodecId::kMxfp8, CodecId::kMxfp6, CodecId::kMxfp4};
constexpr float kInf = std::numeric_limits<float>::infinity();

int BitsOf(CodecId id) { return id == CodecId::kMxfp8 ? 8 : (id == CodecId::kMxfp6 ? 6 : 4); }

std::unique_ptr<Codec> MakeCodec(CodecId id) {
  CodecConfig config;
  config.id = id;
  return NewMxCodec(config);
}

BucketPlan MakePlan(const Codec& codec, size_t num_elements, uint64_t round = 0x500000007ull) {
  RoundInfo info;
  info.round = round;
  info.world_size = 8;
  absl::StatusOr<BucketPlan> plan = codec.MakePlan(info, num_elements, {}, {});
  EXPECT_TRUE(plan.ok());
  return *plan;
}

Source FloatSource(const std::vector<float>& v, size_t first = 0) {
  Source s;
  s.data = v.data();
  s.first = first;
  return s;
}

std::vector<uint8_t> MustCompress(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                                  const Source& src) {
  std::vector<uint8_t> out(codec.MaxEncodedBytes(plan, chunk));
  absl::StatusOr<size_t> n = codec.Compress(plan, chunk, src, absl::MakeSpan(out));
  EXPECT_TRUE(n.ok()) << n.status();
  if (n.ok()) {
    EXPECT_EQ(*n, out.size());
  }
  return out;
}

std::vector<uint8_t> MustDar(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                             const std::vector<uint8_t>& in, const Source& src) {
  std::vector<uint8_t> out(codec.MaxEncodedBytes(plan, chunk));
  absl::StatusOr<size_t> n = codec.DecompressAccumulateRecompress(plan, chunk, in, src, absl::MakeSpan(out));
  EXPECT_TRUE(n.ok()) << n.status();
  if (n.ok()) {
    EXPECT_EQ(*n, out.size());
  }
  return out;
}

std::vector<float> MustDecompress(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                                  const std::vector<uint8_t>& in) {
  std::vector<float> out(chunk.count, -12345.0f);
  Dest dst;
  dst.data = out.data();
  dst.first = chunk.begin;
  DQ_EXPECT_OK(codec.Decompress(plan, chunk, in, dst));
  return out;
}

// The scalar reference: encode v[begin, begin + count) block by block with mx_math.h.
std::vector<uint8_t> ReferencePayload(const MxElementFormat& f, const float* v, size_t count) {
  std::vector<uint8_t> out(MxPayloadBytes(f.bits, count));
  for (size_t i = 0; i < count; i += kMxBlockSize) {
    int n = static_cast<int>(std::min<size_t>(kMxBlockSize, count - i));
    MxEncodeBlock(f, v + i, n, out.data() + (i / kMxBlockSize) * MxBlockBytes(f.bits));
  }
  return out;
}

std::vector<float> ReferenceDecode(const MxElementFormat& f, const uint8_t* payload, size_t count) {
  std::vector<float> out(count);
  for (size_t i = 0; i < count; i += kMxBlockSize) {
    int n = static_cast<int>(std::min<size_t>(kMxBlockSize, count - i));
    MxDecodeBlock(f, payload + (i / kMxBlockSize) * MxBlockBytes(f.bits), n, out.data() + i);
  }
  return out;
}

std::vector<uint8_t> PayloadOf(const std::vector<uint8_t>& chunk) {
  return std::vector<uint8_t>(chunk.begin() + kChunkHeaderBytes, chunk.end());
}

// Brute force: the code nearest to v / 2^shared_exp, ties to the even code, saturating.
uint32_t BruteForceEncode(const MxElementFormat& f, float v, int shared_exp) {
  const double x = fabs(ldexp(static_cast<double>(v), -shared_exp));
  uint32_t best = 0;
  double best_err = INFINITY;
  for (uint32_t c = 0; c <= f.max_code; ++c) {
    double err = fabs(static_cast<double>(MxDecodeElement(f, c)) - x);
    if (err < best_err || (err == best_err && (c & 1u) == 0u)) {
      best = c;
      best_err = err;
    }
  }
  return (signbit(v) ? 1u << (f.bits - 1) : 0u) | best;
}

// |q - x| is at most half an element ulp at the block scale, or x saturated to the max normal.
::testing::AssertionResult WithinHalfUlp(const MxElementFormat& f, uint8_t scale_byte, float x, float q) {
  const int s = static_cast<int>(scale_byte) - 127;
  const double xs = ldexp(static_cast<double>(x), -s);
  const double max_normal = MxDecodeElement(f, f.max_code);
  const double qs = ldexp(static_cast<double>(q), -s);
  if (fabs(xs) > max_normal) {
    if (qs == copysign(max_normal, xs)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << x << " should saturate to " << copysign(max_normal, xs) << " * 2^" << s
                                         << ", got " << q;
  }
  int e = xs == 0.0 ? -1000 : ilogb(xs);
  if (e < 1 - f.bias) e = 1 - f.bias;
  const double half_ulp = ldexp(1.0, e - f.man_bits - 1);
  if (fabs(qs - xs) <= half_ulp) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << x << " decoded as " << q << ": error " << fabs(qs - xs)
                                       << " exceeds half an ulp " << half_ulp << " at scale 2^" << s;
}

// Runs fn once with each Highway target this CPU supports forced, so every SIMD path is checked.
template <typename Fn>
void ForEachHwyTarget(Fn&& fn) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    fn();
  }
  hwy::SetSupportedTargetsForTest(0);
}

// Blocks with very different magnitudes, plus zeros, float subnormals, exact ties and values above
// the max normal.
std::vector<float> HardValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exp_dist(-140, 120);
  std::uniform_int_distribution<uint32_t> bits_dist;
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i += kMxBlockSize) {
    const int kind = static_cast<int>((i / kMxBlockSize) % 6);
    const float block_scale = ldexpf(1.0f, exp_dist(rng));
    for (size_t k = i; k < std::min(n, i + kMxBlockSize); ++k) {
      switch (kind) {
        case 0:
          v[k] = normal(rng) * block_scale;
          break;
        case 1:  // any finite float: huge dynamic range inside one block
          do {
            v[k] = BitsToFloat(bits_dist(rng));
          } while (!isfinite(v[k]));
          break;
        case 2:  // float subnormals and zeros (scale byte 0)
          v[k] = (k % 3 == 0) ? 0.0f : BitsToFloat(bits_dist(rng) & 0x807fffffu);
          break;
        case 3:  // multiples of 1/64 around 1: many exact ties on the E2M1/E3M2/E4M3 grids
          v[k] = static_cast<float>(static_cast<int>(bits_dist(rng) % 1025) - 512) / 64.0f;
          break;
        case 4:  // near the top of the binade: saturation
          v[k] = (k % 2 ? -1.0f : 1.0f) * (1.99f - 0.001f * static_cast<float>(k - i)) * block_scale;
          break;
        default:
          v[k] = k == i ? -0.0f : normal(rng) * 1e-3f;
      }
    }
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Element and block math.

TEST(MxMathTest, ScaleByteFromBlockMax) {
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(1.0f)), 127 - 8);
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(448.0f)), 127);  // floor(log2 448) = 8 = emax
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(511.9f)), 127);
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(512.0f)), 128);
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(0.75f)), 127 - 9);
  EXPECT_EQ(MxScaleByte(kE3M2, FloatBits(28.0f)), 127);
  EXPECT_EQ(MxScaleByte(kE3M2, FloatBits(1.0f)), 127 - 4);
  EXPECT_EQ(MxScaleByte(kE2M1, FloatBits(6.0f)), 127);
  EXPECT_EQ(MxScaleByte(kE2M1, FloatBits(1.0f)), 127 - 2);
  // Zero, subnormal and tiny maxima clamp shared_exp at -127.
  EXPECT_EQ(MxScaleByte(kE4M3, 0u), 0);
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(1e-40f)), 0);
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(ldexpf(1.0f, -126))), 0);
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(ldexpf(1.0f, -118))), 1);
  EXPECT_EQ(MxScaleByte(kE2M1, FloatBits(ldexpf(1.0f, -125))), 0);
  EXPECT_EQ(MxScaleByte(kE2M1, FloatBits(ldexpf(1.0f, -124))), 1);
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(std::numeric_limits<float>::max())), 254 - 8);
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(kInf)), kMxNanScale);
  EXPECT_EQ(MxScaleByte(kE4M3, FloatBits(NAN) & 0x7fffffffu), kMxNanScale);
  // Matches the spec formula for normal maxima.
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  for (const MxElementFormat& f : {kE4M3, kE3M2, kE2M1}) {
    for (int e = -126; e <= 127; ++e) {
      const float max = ldexpf(mant(rng), e);
      const int shared = std::clamp(static_cast<int>(floor(log2(static_cast<double>(max)))) - f.emax, -127, 127);
      EXPECT_EQ(MxScaleByte(f, FloatBits(max)), shared + 127) << max;
      EXPECT_EQ(MxScaleValue(static_cast<uint8_t>(shared + 127)), static_cast<float>(ldexp(1.0, shared)));
    }
  }
  EXPECT_EQ(MxScaleValue(0), static_cast<float>(ldexp(1.0, -127)));
}

TEST(MxMathTest, ElementValueTables) {
  const float e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(MxDecodeElement(kE2M1, c), e2m1[c]) << c;
    EXPECT_EQ(signbit(MxDecodeElement(kE2M1, c)), c >= 8) << c;
  }
  EXPECT_EQ(MxDecodeElement(kE4M3, 0x7e), 448.0f);
  EXPECT_EQ(MxDecodeElement(kE4M3, 0xfe), -448.0f);
  EXPECT_EQ(MxDecodeElement(kE4M3, 0x38), 1.0f);
  EXPECT_EQ(MxDecodeElement(kE4M3, 0x08), ldexpf(1.0f, -6));  // min normal
  EXPECT_EQ(MxDecodeElement(kE4M3, 0x07), 7 * ldexpf(1.0f, -9));
  EXPECT_EQ(MxDecodeElement(kE4M3, 0x01), ldexpf(1.0f, -9));
  EXPECT_EQ(MxDecodeElement(kE3M2, 0x1f), 28.0f);
  EXPECT_EQ(MxDecodeElement(kE3M2, 0x0c), 1.0f);
  EXPECT_EQ(MxDecodeElement(kE3M2, 0x04), 0.25f);
  EXPECT_EQ(MxDecodeElement(kE3M2, 0x01), 0.0625f);
  EXPECT_EQ(MxDecodeElement(kE3M2, 0x3f), -28.0f);
  // Only E4M3 has an illegal (NaN) code.
  for (uint32_t c = 0; c < 256; ++c) EXPECT_EQ(MxIsIllegalCode(kE4M3, c), c == 0x7f || c == 0xff) << c;
  for (uint32_t c = 0; c < 64; ++c) EXPECT_FALSE(MxIsIllegalCode(kE3M2, c));
  for (uint32_t c = 0; c < 16; ++c) EXPECT_FALSE(MxIsIllegalCode(kE2M1, c));
}

TEST(MxMathTest, SaturatesAtMaxNormal) {
  EXPECT_EQ(MxEncodeElement(kE4M3, 448.0f, 0), 0x7eu);
  EXPECT_EQ(MxEncodeElement(kE4M3, 464.0f, 0), 0x7eu);  // tie with 480, which would be the NaN code
  EXPECT_EQ(MxEncodeElement(kE4M3, 500.0f, 0), 0x7eu);
  EXPECT_EQ(MxEncodeElement(kE4M3, 1e30f, 0), 0x7eu);
  EXPECT_EQ(MxEncodeElement(kE4M3, -1000.0f, 0), 0xfeu);
  EXPECT_EQ(MxEncodeElement(kE3M2, 28.0f, 0), 0x1fu);
  EXPECT_EQ(MxEncodeElement(kE3M2, 31.9f, 0), 0x1fu);
  EXPECT_EQ(MxEncodeElement(kE3M2, -100.0f, 0), 0x3fu);
  EXPECT_EQ(MxEncodeElement(kE2M1, 6.0f, 0), 0x7u);
  EXPECT_EQ(MxEncodeElement(kE2M1, 7.9f, 0), 0x7u);
  EXPECT_EQ(MxEncodeElement(kE2M1, -6.5f, 0), 0xfu);
  // In a block: the max sets the scale, and the top of its binade clips.
  float v[kMxBlockSize] = {500.0f, -300.0f, 1.0f};
  uint8_t block[33];
  MxEncodeBlock(kE4M3, v, 3, block);
  EXPECT_EQ(block[0], 127);
  EXPECT_EQ(block[1], 0x7e);
  EXPECT_EQ(block[2], 0x80 | 0x79);  // 288 = 1.125 * 2^8; 300 is nearer 288 than 320
  EXPECT_EQ(block[3], 0x38);
}

TEST(MxMathTest, RoundsTiesToEven) {
  EXPECT_EQ(MxEncodeElement(kE4M3, 1.0625f, 0), 0x38u);  // 1 | 1.125 -> 1
  EXPECT_EQ(MxEncodeElement(kE4M3, 1.1875f, 0), 0x3au);  // 1.125 | 1.25 -> 1.25
  EXPECT_EQ(MxEncodeElement(kE4M3, 1.3125f, 0), 0x3au);  // 1.25 | 1.375 -> 1.25
  EXPECT_EQ(MxEncodeElement(kE4M3, 17.0f, 0), 0x58u);    // 16 | 18 -> 16
  EXPECT_EQ(MxEncodeElement(kE4M3, 19.0f, 0), 0x5au);    // 18 | 20 -> 20
  EXPECT_EQ(MxEncodeElement(kE4M3, 15.5f, 0), 0x58u);    // 15 | 16 -> 16 (carry into next binade)
  EXPECT_EQ(MxEncodeElement(kE3M2, 1.125f, 0), 0x0cu);   // 1 | 1.25 -> 1
  EXPECT_EQ(MxEncodeElement(kE3M2, 1.375f, 0), 0x0eu);   // 1.25 | 1.5 -> 1.5
  const struct {
    float x;
    uint32_t code;
  } e2m1[] = {{0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4},   {3.5f, 6},
              {5.0f, 6},  {0.26f, 1}, {2.6f, 5},  {4.9f, 6},  {-2.5f, 12}, {-5.0f, 14}};
  for (const auto& t : e2m1) EXPECT_EQ(MxEncodeElement(kE2M1, t.x, 0), t.code) << t.x;
  // Ties at a nonzero shared exponent: 2.5 * 2^-3 with shared_exp -3 rounds to 2 * 2^-3.
  EXPECT_EQ(MxEncodeElement(kE2M1, 0.3125f, -3), 4u);
}

TEST(MxMathTest, Subnormals) {
  const float u = ldexpf(1.0f, -9);  // E4M3 subnormal step
  EXPECT_EQ(MxEncodeElement(kE4M3, u, 0), 0x01u);
  EXPECT_EQ(MxEncodeElement(kE4M3, u / 2, 0), 0x00u);  // tie 0 | u -> 0
  EXPECT_EQ(MxEncodeElement(kE4M3, u * 0.51f, 0), 0x01u);
  EXPECT_EQ(MxEncodeElement(kE4M3, u / 4, 0), 0x00u);
  EXPECT_EQ(MxEncodeElement(kE4M3, 1.5f * u, 0), 0x02u);  // tie 1 | 2 -> 2
  EXPECT_EQ(MxEncodeElement(kE4M3, 2.5f * u, 0), 0x02u);  // tie 2 | 3 -> 2
  EXPECT_EQ(MxEncodeElement(kE4M3, 7.0f * u, 0), 0x07u);  // max subnormal
  EXPECT_EQ(MxEncodeElement(kE4M3, 7.5f * u, 0), 0x08u);  // tie 7 | 8 -> min normal
  EXPECT_EQ(MxEncodeElement(kE4M3, -u, 0), 0x81u);
  EXPECT_EQ(MxEncodeElement(kE4M3, -u / 4, 0), 0x80u);  // sign kept on zero
  EXPECT_EQ(MxEncodeElement(kE3M2, 0.0625f, 0), 0x01u);
  EXPECT_EQ(MxEncodeElement(kE3M2, 0.09375f, 0), 0x02u);  // tie 1 | 2 -> 2
  EXPECT_EQ(MxEncodeElement(kE2M1, 0.5f, 0), 0x01u);
  // fp32 subnormal inputs with the clamped shared exponent -127.
  EXPECT_EQ(MxEncodeElement(kE4M3, ldexpf(1.0f, -135), -127), 0x02u);  // 2^-8 = 2 * 2^-9
  EXPECT_EQ(MxEncodeElement(kE4M3, ldexpf(3.0f, -149), -127), 0x00u);
  EXPECT_EQ(MxEncodeElement(kE4M3, ldexpf(1.0f, -127), -127), 0x38u);   // 1.0
  EXPECT_EQ(MxEncodeElement(kE4M3, ldexpf(0.75f, -126), -127), 0x3cu);  // 1.5
  EXPECT_EQ(MxEncodeElement(kE2M1, ldexpf(1.0f, -149), -127), 0x00u);
  // A subnormal-only block round-trips exactly when on the grid.
  float v[kMxBlockSize] = {ldexpf(1.5f, -127), ldexpf(-1.0f, -130), ldexpf(1.0f, -136)};
  uint8_t block[33];
  float out[3];
  MxEncodeBlock(kE4M3, v, 3, block);
  EXPECT_EQ(block[0], 0);
  MxDecodeBlock(kE4M3, block, 3, out);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(out[k], v[k]) << k;
}

TEST(MxMathTest, ZeroBlock) {
  for (const MxElementFormat& f : {kE4M3, kE3M2, kE2M1}) {
    float v[kMxBlockSize] = {};
    uint8_t block[33];
    memset(block, 0xab, sizeof(block));
    MxEncodeBlock(f, v, kMxBlockSize, block);
    EXPECT_EQ(block[0], 0);
    for (int b = 1; b < MxBlockBytes(f.bits); ++b) EXPECT_EQ(block[b], 0) << b;
    int bad = -1;
    EXPECT_EQ(MxValidateBlock(f, block, kMxBlockSize, &bad), kMxBlockOk);
    float out[kMxBlockSize];
    MxDecodeBlock(f, block, kMxBlockSize, out);
    for (float x : out) EXPECT_EQ(FloatBits(x), 0u);
  }
}

// Exhaustive around every grid point: the midpoints between neighbouring codes and one float ulp
// either side, at several shared exponents, against the brute-force nearest-even encoder.
TEST(MxMathTest, MatchesBruteForceAtEveryMidpoint) {
  for (const MxElementFormat& f : {kE4M3, kE3M2, kE2M1}) {
    for (int s : {-127, -120, -9, 0, 5, 119}) {
      for (uint32_t c = 0; c <= f.max_code; ++c) {
        const double lo = MxDecodeElement(f, c);
        const double hi = c < f.max_code ? MxDecodeElement(f, c + 1) : lo * 1.25;
        const float mid = static_cast<float>(ldexp((lo + hi) / 2, s));
        for (float x : {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY), static_cast<float>(ldexp(lo, s))}) {
          if (!isfinite(x)) continue;
          for (float v : {x, -x}) {
            ASSERT_EQ(MxEncodeElement(f, v, s), BruteForceEncode(f, v, s))
                << "bits " << f.bits << " s " << s << " v " << v;
          }
        }
      }
    }
  }
}

TEST(MxMathTest, RandomBlocksMatchBruteForceAndHalfUlpBound) {
  const std::vector<float> v = HardValues(32 * 600, 7);
  for (const MxElementFormat& f : {kE4M3, kE3M2, kE2M1}) {
    for (size_t i = 0; i < v.size(); i += kMxBlockSize) {
      uint8_t block[33];
      MxEncodeBlock(f, v.data() + i, kMxBlockSize, block);
      int bad = -1;
      ASSERT_EQ(MxValidateBlock(f, block, kMxBlockSize, &bad), kMxBlockOk);
      float out[kMxBlockSize];
      MxDecodeBlock(f, block, kMxBlockSize, out);
      const int s = block[0] - 127;
      for (int k = 0; k < kMxBlockSize; ++k) {
        ASSERT_EQ(MxUnpackCode(block + 1, k, f.bits), BruteForceEncode(f, v[i + k], s))
            << "bits " << f.bits << " v " << v[i + k] << " s " << s;
        ASSERT_TRUE(WithinHalfUlp(f, block[0], v[i + k], out[k]));
      }
    }
  }
}

TEST(MxMathTest, PackingIsLsbFirst) {
  uint8_t codes[24] = {};
  for (int k = 0; k < kMxBlockSize; ++k) MxPackCode(codes, k, 6, static_cast<uint32_t>(k + 20) & 0x3fu);
  for (int k = 0; k < kMxBlockSize; ++k) EXPECT_EQ(MxUnpackCode(codes, k, 6), static_cast<uint32_t>(k + 20) & 0x3fu);
  // Code 1 (value 21 = 0b010101) starts at bit 6 of byte 0 and continues in byte 1.
  EXPECT_EQ(codes[0], static_cast<uint8_t>(20 | ((21 & 0x3) << 6)));
  EXPECT_EQ(codes[1] & 0xf, 21 >> 2);
  uint8_t nibbles[16] = {};
  MxPackCode(nibbles, 0, 4, 0x3);
  MxPackCode(nibbles, 1, 4, 0xa);
  EXPECT_EQ(nibbles[0], 0xa3);
}

// ---------------------------------------------------------------------------------------------
// The codec.

TEST(MxCodecTest, FactoryAndDescribe) {
  EXPECT_EQ(MakeCodec(CodecId::kMxfp8)->Describe(),
            "mxfp8: OCP MX E4M3 elements, E8M0 scale per 32, 8.25 bits/coord + 32 B header per chunk");
  EXPECT_EQ(MakeCodec(CodecId::kMxfp6)->Describe(),
            "mxfp6: OCP MX E3M2 elements, E8M0 scale per 32, 6.25 bits/coord + 32 B header per chunk");
  EXPECT_EQ(MakeCodec(CodecId::kMxfp4)->Describe(),
            "mxfp4: OCP MX E2M1 elements, E8M0 scale per 32, 4.25 bits/coord + 32 B header per chunk");
  CodecConfig config;
  config.id = CodecId::kDynamiq;
  EXPECT_EQ(NewMxCodec(config), nullptr);
  EXPECT_EQ(MakeCodec(CodecId::kMxfp4)->id(), CodecId::kMxfp4);
  EXPECT_EQ(MakeCodec(CodecId::kMxfp8)->StatsLength(1 << 20), 0u);
}

TEST(MxCodecTest, EncodedSizeAndHeader) {
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    const int w = BitsOf(id);
    const BucketPlan plan = MakePlan(*codec, 4096);
    const ChunkRef chunk{3, 1024, 1000};  // 31 full blocks + 8 elements
    EXPECT_EQ(codec->MaxEncodedBytes(plan, chunk), kChunkHeaderBytes + 32u * (1 + 4 * w));
    EXPECT_EQ(codec->MaxEncodedBytes(plan, ChunkRef{0, 0, 2048}), kChunkHeaderBytes + 2048 * (w + 0.25) / 8);
    std::vector<float> v(4096, 0.5f);
    std::vector<uint8_t> bytes = MustCompress(*codec, plan, chunk, FloatSource(v));
    absl::StatusOr<ChunkHeader> h = ParseChunkHeader(bytes);
    DQ_ASSERT_OK(h);
    EXPECT_EQ(h->codec, id);
    EXPECT_EQ(h->element_bits, w);
    EXPECT_EQ(h->flags, 0);
    EXPECT_EQ(h->num_elements, 1000u);
    EXPECT_EQ(h->chunk_id, 3u);
    EXPECT_EQ(h->round, 7u);  // low 32 bits of 0x500000007
    EXPECT_EQ(h->num_summands, 1);
    EXPECT_EQ(h->payload_bytes, 32u * (1 + 4 * w));
    EXPECT_EQ(h->param, 0.0f);
  }
}

TEST(MxCodecTest, CompressMatchesScalarMathOnEveryTarget) {
  const std::vector<float> v = HardValues(32 * 3000 + 13, 11);
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    const MxElementFormat f = MxFormatForBits(BitsOf(id));
    const BucketPlan plan = MakePlan(*codec, v.size());
    const ChunkRef chunk{0, 0, v.size()};
    const std::vector<uint8_t> expected = ReferencePayload(f, v.data(), v.size());
    ForEachHwyTarget([&] { EXPECT_EQ(PayloadOf(MustCompress(*codec, plan, chunk, FloatSource(v))), expected); });
  }
}

TEST(MxCodecTest, RoundTripWithinHalfUlp) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> v(5000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = normal(rng) * ldexpf(1.0f, static_cast<int>(i / 256) - 10);
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    const MxElementFormat f = MxFormatForBits(BitsOf(id));
    const BucketPlan plan = MakePlan(*codec, v.size());
    const ChunkRef chunk{1, 256, v.size() - 256};
    std::vector<uint8_t> bytes = MustCompress(*codec, plan, chunk, FloatSource(v));
    std::vector<float> out = MustDecompress(*codec, plan, chunk, bytes);
    const std::vector<uint8_t> payload = PayloadOf(bytes);
    EXPECT_EQ(out, ReferenceDecode(f, payload.data(), chunk.count));
    for (size_t i = 0; i < chunk.count; ++i) {
      const uint8_t scale = payload[(i / kMxBlockSize) * MxBlockBytes(f.bits)];
      ASSERT_TRUE(WithinHalfUlp(f, scale, v[chunk.begin + i], out[i])) << i;
    }
  }
}

TEST(MxCodecTest, ZeroChunkDecodesToZero) {
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    std::vector<float> v(100, 0.0f);
    const BucketPlan plan = MakePlan(*codec, v.size());
    const ChunkRef chunk{0, 0, v.size()};
    std::vector<uint8_t> bytes = MustCompress(*codec, plan, chunk, FloatSource(v));
    for (size_t b = kChunkHeaderBytes; b < bytes.size(); ++b) EXPECT_EQ(bytes[b], 0) << b;
    EXPECT_EQ(MustDecompress(*codec, plan, chunk, bytes), v);
  }
}

TEST(MxCodecTest, CountsNotMultipleOf32) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> v(512);
  for (float& x : v) x = normal(rng);
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    const MxElementFormat f = MxFormatForBits(BitsOf(id));
    const BucketPlan plan = MakePlan(*codec, v.size());
    for (size_t count : {0, 1, 5, 31, 32, 33, 63, 255}) {
      SCOPED_TRACE(count);
      const ChunkRef chunk{1, 256, count};
      std::vector<uint8_t> bytes = MustCompress(*codec, plan, chunk, FloatSource(v));
      EXPECT_EQ(bytes.size(), kChunkHeaderBytes + ((count + 31) / 32) * MxBlockBytes(f.bits));
      EXPECT_EQ(PayloadOf(bytes), ReferencePayload(f, v.data() + 256, count));
      std::vector<float> out = MustDecompress(*codec, plan, chunk, bytes);
      for (size_t i = 0; i < count; ++i) {
        const uint8_t scale = bytes[kChunkHeaderBytes + (i / 32) * MxBlockBytes(f.bits)];
        EXPECT_TRUE(WithinHalfUlp(f, scale, v[256 + i], out[i]));
      }
    }
  }
}

TEST(MxCodecTest, DecompressIntoBf16AndWithOffsets) {
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  std::vector<float> v(700);
  for (float& x : v) x = normal(rng) * 3.0f;
  const float means[3] = {0.25f, -1.5f, 1000.0f};
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    const BucketPlan plan = MakePlan(*codec, v.size());
    const ChunkRef chunk{2, 256, 444};
    std::vector<uint8_t> bytes = MustCompress(*codec, plan, chunk, FloatSource(v));
    const std::vector<float> decoded = MustDecompress(*codec, plan, chunk, bytes);

    // bf16 destination whose buffer starts at bucket element 200, with per-super-group offsets.
    std::vector<uint16_t> out(600, 0xdead);
    Dest dst;
    dst.data = out.data();
    dst.dtype = DType::kBFloat16;
    dst.first = 200;
    dst.add_per_group = means;
    DQ_ASSERT_OK(codec->Decompress(plan, chunk, bytes, dst));
    for (size_t i = 0; i < out.size(); ++i) {
      const size_t k = 200 + i;
      if (k < chunk.begin || k >= chunk.begin + chunk.count) {
        EXPECT_EQ(out[i], 0xdead) << k;  // nothing outside the chunk is written
      } else {
        EXPECT_EQ(out[i], FloatToBf16(decoded[k - chunk.begin] + means[k / 256])) << k;
      }
    }

    // fp32 destination with offsets.
    std::vector<float> out32(chunk.count);
    Dest dst32;
    dst32.data = out32.data();
    dst32.first = chunk.begin;
    dst32.add_per_group = means;
    DQ_ASSERT_OK(codec->Decompress(plan, chunk, bytes, dst32));
    for (size_t i = 0; i < chunk.count; ++i) {
      EXPECT_EQ(out32[i], decoded[i] + means[(chunk.begin + i) / 256]);
    }
  }
}

TEST(MxCodecTest, Bf16SourceAndSubtractedMeans) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> bf(600);
  for (uint16_t& x : bf) x = FloatToBf16(normal(rng));
  const float means[3] = {0.5f, -0.25f, 2.0f};
  std::vector<float> expected(600);
  for (size_t k = 0; k < bf.size(); ++k) expected[k] = Bf16ToFloat(bf[k]) - means[k / 256];
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    const BucketPlan plan = MakePlan(*codec, bf.size());
    const ChunkRef chunk{0, 0, bf.size()};
    Source src;
    src.data = bf.data();
    src.dtype = DType::kBFloat16;
    src.subtract_per_group = means;
    EXPECT_EQ(MustCompress(*codec, plan, chunk, src), MustCompress(*codec, plan, chunk, FloatSource(expected)));
  }
}

TEST(MxCodecTest, DecompressAccumulateAdds) {
  std::mt19937 rng(10);
  std::normal_distribution<float> normal;
  std::vector<float> v(300);
  for (float& x : v) x = normal(rng);
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    const BucketPlan plan = MakePlan(*codec, v.size());
    const ChunkRef chunk{0, 0, v.size()};
    std::vector<uint8_t> bytes = MustCompress(*codec, plan, chunk, FloatSource(v));
    const std::vector<float> decoded = MustDecompress(*codec, plan, chunk, bytes);
    std::vector<float> acc(v.size());
    for (size_t i = 0; i < acc.size(); ++i) acc[i] = static_cast<float>(i) * 0.125f;
    std::vector<float> expected = acc;
    for (size_t i = 0; i < acc.size(); ++i) expected[i] += decoded[i];
    DQ_ASSERT_OK(codec->DecompressAccumulate(plan, chunk, bytes, acc.data()));
    EXPECT_EQ(acc, expected);
  }
}

// DAR must equal decoding the received blocks, adding the local values in fp32, and encoding the sum
// with the scalar math, on every SIMD target.
TEST(MxCodecTest, DarEqualsDecodeAddCompress) {
  const std::vector<float> x0 = HardValues(32 * 64 + 17, 21);
  const std::vector<float> x1 = HardValues(32 * 64 + 17, 22);
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    const MxElementFormat f = MxFormatForBits(BitsOf(id));
    const BucketPlan plan = MakePlan(*codec, x0.size());
    const ChunkRef chunk{0, 0, x0.size()};
    const std::vector<uint8_t> in = MustCompress(*codec, plan, chunk, FloatSource(x0));
    const std::vector<uint8_t> in_payload = PayloadOf(in);
    std::vector<float> sum = ReferenceDecode(f, in_payload.data(), chunk.count);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += x1[i];
    const std::vector<uint8_t> expected = ReferencePayload(f, sum.data(), sum.size());
    ForEachHwyTarget([&] {
      std::vector<uint8_t> out = MustDar(*codec, plan, chunk, in, FloatSource(x1));
      EXPECT_EQ(PayloadOf(out), expected);
      absl::StatusOr<ChunkHeader> h = ParseChunkHeader(out);
      DQ_ASSERT_OK(h);
      EXPECT_EQ(h->num_summands, 2);
      // A second hop counts one more summand.
      std::vector<uint8_t> out2 = MustDar(*codec, plan, chunk, out, FloatSource(x0));
      h = ParseChunkHeader(out2);
      DQ_ASSERT_OK(h);
      EXPECT_EQ(h->num_summands, 3);
      // In place: out may be the input buffer.
      std::vector<uint8_t> inplace = in;
      absl::StatusOr<size_t> n =
          codec->DecompressAccumulateRecompress(plan, chunk, inplace, FloatSource(x1), absl::MakeSpan(inplace));
      DQ_ASSERT_OK(n);
      EXPECT_EQ(inplace, out);
    });
  }
}

TEST(MxCodecTest, NonFiniteBlocksDecodeToNan) {
  for (CodecId id : kMxIds) {
    auto codec = MakeCodec(id);
    std::vector<float> v(32 * 5, 1.0f);
    v[40] = kInf;  // block 1
    v[100] = NAN;  // block 3
    v[101] = -kInf;
    const BucketPlan plan = MakePlan(*codec, v.size());
    const ChunkRef chunk{0, 0, v.size()};
    std::vector<uint8_t> bytes = MustCompress(*codec, plan, chunk, FloatSource(v));
    const int block_bytes = MxBlockBytes(BitsOf(id));
    for (int b : {1, 3}) {
      EXPECT_EQ(bytes[kChunkHeaderBytes + b * block_bytes], kMxNanScale);
      for (int k = 1; k < block_bytes; ++k) EXPECT_EQ(bytes[kChunkHeaderBytes + b * block_bytes + k], 0);
    }
    std::vector<float> out = MustDecompress(*codec, plan, chunk, bytes);
    for (size_t i = 0; i < v.size(); ++i) {
      const bool nan_block = i / 32 == 1 || i / 32 == 3;
      if (nan_block) {
        EXPECT_TRUE(isnan(out[i])) << i;
      } else {
        EXPECT_EQ(out[i], 1.0f) << i;
      }
    }
    // DAR keeps NaN blocks NaN, turns a block whose local values or sum are not finite into NaN.
    std::vector<float> local(v.size(), 0.5f);
    local[5] = -kInf;      // block 0
    local[130] = 3.0e38f;  // block 4: finite, and so is the sum
    std::vector<float> big(v.size(), 3.0e38f);
    std::vector<uint8_t> dar = MustDar(*codec, plan, chunk, bytes, FloatSource(local));
    std::vector<float> dar_out = MustDecompress(*codec, plan, chunk, dar);
    for (size_t i = 0; i < v.size(); ++i) {
      const size_t b = i / 32;
      EXPECT_EQ(isnan(dar_out[i]), b == 0 || b == 1 || b == 3) << i;
    }
    std::vector<uint8_t> big_chunk = MustCompress(*codec, plan, chunk, FloatSource(big));
    std::vector<float> overflow =
        MustDecompress(*codec, plan, chunk, MustDar(*codec, plan, chunk, big_chunk, FloatSource(big)));
    for (float x : overflow) EXPECT_TRUE(isnan(x));  // 3e38 + 3e38 overflows to Inf
    // DecompressAccumulate propagates NaN.
    std::vector<float> acc(v.size(), 0.0f);
    DQ_ASSERT_OK(codec->DecompressAccumulate(plan, chunk, bytes, acc.data()));
    EXPECT_TRUE(isnan(acc[40]));
    EXPECT_EQ(acc[0], 1.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// Malformed input: every decoder path returns the specific error and writes nothing.

class MalformedTest : public ::testing::TestWithParam<CodecId> {
 protected:
  void SetUp() override {
    codec_ = MakeCodec(GetParam());
    f_ = MxFormatForBits(BitsOf(GetParam()));
    std::mt19937 rng(12);
    std::normal_distribution<float> normal;
    values_.resize(512);
    for (float& x : values_) x = normal(rng);
    plan_ = MakePlan(*codec_, values_.size());
    chunk_ = ChunkRef{1, 256, 200};  // 6 full blocks + 8 elements
    good_ = MustCompress(*codec_, plan_, chunk_, FloatSource(values_));
  }

  // Runs all three decoders on `bytes` (for `chunk` of `plan`), expects each to fail with `code` and
  // `substr`, and checks that none wrote output.
  void ExpectAllFail(const std::vector<uint8_t>& bytes, absl::StatusCode code, const std::string& substr,
                     const BucketPlan* plan = nullptr, const ChunkRef* chunk = nullptr) {
    const BucketPlan& p = plan ? *plan : plan_;
    const ChunkRef& c = chunk ? *chunk : chunk_;
    std::vector<float> out(values_.size(), -7.0f);
    Dest dst;
    dst.data = out.data();
    dst.first = 0;
    EXPECT_THAT(codec_->Decompress(p, c, bytes, dst), StatusIs(code, HasSubstr(substr)));
    EXPECT_THAT(codec_->DecompressAccumulate(p, c, bytes, out.data() + c.begin), StatusIs(code, HasSubstr(substr)));
    for (float x : out) ASSERT_EQ(x, -7.0f);
    std::vector<uint8_t> dar(codec_->MaxEncodedBytes(p, c) + 8, 0x5a);
    EXPECT_THAT(codec_->DecompressAccumulateRecompress(p, c, bytes, FloatSource(values_), absl::MakeSpan(dar)),
                StatusIs(code, HasSubstr(substr)));
    for (uint8_t b : dar) ASSERT_EQ(b, 0x5a);
  }

  std::vector<uint8_t> WithHeader(void (*edit)(ChunkHeader&)) const {
    std::vector<uint8_t> bytes = good_;
    ChunkHeader h = *ParseChunkHeader(bytes);
    edit(h);
    WriteChunkHeader(h, absl::MakeSpan(bytes));
    return bytes;
  }

  uint8_t* Block(std::vector<uint8_t>& bytes, int b) const {
    return bytes.data() + kChunkHeaderBytes + b * MxBlockBytes(f_.bits);
  }

  std::unique_ptr<Codec> codec_;
  MxElementFormat f_;
  std::vector<float> values_;
  BucketPlan plan_;
  ChunkRef chunk_;
  std::vector<uint8_t> good_;
};

TEST_P(MalformedTest, GoodChunkDecodes) {
  std::vector<float> out(values_.size());
  Dest dst;
  dst.data = out.data();
  DQ_EXPECT_OK(codec_->Decompress(plan_, chunk_, good_, dst));
}

TEST_P(MalformedTest, EveryTruncation) {
  for (size_t n = 0; n < good_.size(); ++n) {
    SCOPED_TRACE(n);
    ExpectAllFail(std::vector<uint8_t>(good_.begin(), good_.begin() + n), absl::StatusCode::kDataLoss, "truncated");
  }
}

TEST_P(MalformedTest, WrongMagic) {
  std::vector<uint8_t> bytes = good_;
  bytes[0] = 'X';
  ExpectAllFail(bytes, absl::StatusCode::kInvalidArgument, "magic");
}

TEST_P(MalformedTest, WrongCodec) {
  const CodecId other = GetParam() == CodecId::kMxfp4 ? CodecId::kMxfp8 : CodecId::kMxfp4;
  auto other_codec = MakeCodec(other);
  std::vector<uint8_t> bytes = MustCompress(*other_codec, plan_, chunk_, FloatSource(values_));
  ExpectAllFail(bytes, absl::StatusCode::kInvalidArgument,
                absl::StrCat("compressed with codec ", CodecName(other), ", expected ", CodecName(GetParam())));
}

TEST_P(MalformedTest, WrongChunkIdCountOrRound) {
  ChunkRef other_id = chunk_;
  other_id.chunk_id = 2;
  ExpectAllFail(good_, absl::StatusCode::kInvalidArgument, "received chunk id 1, expected 2", &plan_, &other_id);
  ChunkRef other_count = chunk_;
  other_count.count = 199;
  ExpectAllFail(good_, absl::StatusCode::kInvalidArgument, "holds 200 elements, expected 199", &plan_, &other_count);
  BucketPlan other_round = plan_;
  other_round.round.round += 1;
  ExpectAllFail(good_, absl::StatusCode::kInvalidArgument, "belongs to round 7, expected round 8", &other_round);
}

TEST_P(MalformedTest, HugeElementCount) {
  ExpectAllFail(WithHeader([](ChunkHeader& h) { h.num_elements = kMaxChunkElements + 1; }),
                absl::StatusCode::kInvalidArgument, "the limit is");
  ExpectAllFail(WithHeader([](ChunkHeader& h) { h.num_elements = kMaxChunkElements; }),
                absl::StatusCode::kInvalidArgument, "holds 1073741824 elements, expected 200");
  ExpectAllFail(WithHeader([](ChunkHeader& h) { h.num_elements = 0xffffffffu; }), absl::StatusCode::kInvalidArgument,
                "the limit is");
}

TEST_P(MalformedTest, PayloadSizeMismatch) {
  const size_t expected = good_.size() - kChunkHeaderBytes;
  ExpectAllFail(WithHeader([](ChunkHeader& h) { h.payload_bytes -= 1; }), absl::StatusCode::kInvalidArgument,
                absl::StrCat("payload is ", expected - 1, " bytes, expected ", expected));
  // Longer than what is present: truncated.
  ExpectAllFail(WithHeader([](ChunkHeader& h) { h.payload_bytes += 1; }), absl::StatusCode::kDataLoss, "truncated");
  // Longer and present (but not what this chunk needs).
  std::vector<uint8_t> longer = WithHeader([](ChunkHeader& h) { h.payload_bytes += 4; });
  longer.resize(longer.size() + 4, 0);
  ExpectAllFail(longer, absl::StatusCode::kInvalidArgument, "payload is");
  // Extra bytes after a correct chunk are ignored.
  std::vector<uint8_t> padded = good_;
  padded.resize(padded.size() + 16, 0xee);
  std::vector<float> out(values_.size());
  Dest dst;
  dst.data = out.data();
  DQ_EXPECT_OK(codec_->Decompress(plan_, chunk_, padded, dst));
}

TEST_P(MalformedTest, WrongElementBitsFlagsOrParam) {
  ExpectAllFail(WithHeader([](ChunkHeader& h) { h.element_bits = 5; }), absl::StatusCode::kInvalidArgument,
                "element_bits 5");
  ExpectAllFail(WithHeader([](ChunkHeader& h) { h.flags = kFlagCorrelated; }), absl::StatusCode::kInvalidArgument,
                "flags 1");
  ExpectAllFail(WithHeader([](ChunkHeader& h) { h.param = 2.0f; }), absl::StatusCode::kInvalidArgument, "param 2");
}

TEST_P(MalformedTest, NanScaleBlockWithCodes) {
  std::vector<uint8_t> bytes = good_;
  Block(bytes, 2)[0] = kMxNanScale;
  ExpectAllFail(bytes, absl::StatusCode::kDataLoss, "block 2 element 0");
  ExpectAllFail(bytes, absl::StatusCode::kDataLoss, "NaN-scale (0xFF) block");
  // With all-zero codes it is the legal NaN block.
  memset(Block(bytes, 2) + 1, 0, MxBlockBytes(f_.bits) - 1);
  std::vector<float> out(values_.size());
  Dest dst;
  dst.data = out.data();
  DQ_ASSERT_OK(codec_->Decompress(plan_, chunk_, bytes, dst));
  EXPECT_TRUE(isnan(out[chunk_.begin + 64]));
  EXPECT_FALSE(isnan(out[chunk_.begin + 63]));
  EXPECT_FALSE(isnan(out[chunk_.begin + 96]));
}

TEST_P(MalformedTest, NonZeroPadding) {
  std::vector<uint8_t> bytes = good_;
  // The last block holds 8 elements; code 31 is padding.
  MxPackCode(Block(bytes, 6) + 1, 31, f_.bits, 1);
  ExpectAllFail(bytes, absl::StatusCode::kDataLoss, "block 6 element 31: code 0x1 in the padding");
}

TEST_P(MalformedTest, AnyScaleByteBelow255IsLegal) {
  std::vector<uint8_t> bytes = good_;
  for (int s = 0; s < 255; ++s) {
    Block(bytes, 0)[0] = static_cast<uint8_t>(s);
    std::vector<float> out(chunk_.count);
    DQ_ASSERT_OK(codec_->DecompressAccumulate(plan_, chunk_, bytes, out.data()));
  }
}

TEST_P(MalformedTest, IllegalE4M3NanCode) {
  std::vector<uint8_t> bytes = good_;
  if (GetParam() != CodecId::kMxfp8) {
    // Every E3M2 / E2M1 code is a number.
    memset(Block(bytes, 3) + 1, 0xff, MxBlockBytes(f_.bits) - 1);
    std::vector<float> out(chunk_.count);
    DQ_EXPECT_OK(codec_->DecompressAccumulate(plan_, chunk_, bytes, out.data()));
    return;
  }
  Block(bytes, 3)[1 + 5] = 0x7f;
  ExpectAllFail(bytes, absl::StatusCode::kDataLoss, "block 3 element 5: code 0x7f is the E4M3 NaN pattern");
  bytes = good_;
  Block(bytes, 6)[1 + 7] = 0xff;  // in the partial last block
  ExpectAllFail(bytes, absl::StatusCode::kDataLoss, "block 6 element 7: code 0xff is the E4M3 NaN pattern");
}

TEST_P(MalformedTest, OutputTooSmall) {
  std::vector<uint8_t> out(good_.size() - 1, 0x5a);
  EXPECT_THAT(codec_->Compress(plan_, chunk_, FloatSource(values_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too small")));
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, good_, FloatSource(values_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too small")));
  for (uint8_t b : out) ASSERT_EQ(b, 0x5a);
  ChunkRef outside = chunk_;
  outside.begin = 400;
  std::vector<uint8_t> big(1000);
  EXPECT_THAT(codec_->Compress(plan_, outside, FloatSource(values_), absl::MakeSpan(big)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the bucket")));
}

TEST_P(MalformedTest, SummandCountOverflow) {
  ExpectAllFail(WithHeader([](ChunkHeader& h) { h.num_summands = 0; }), absl::StatusCode::kInvalidArgument,
                "0 summands");
  std::vector<uint8_t> full = WithHeader([](ChunkHeader& h) { h.num_summands = UINT16_MAX; });
  std::vector<uint8_t> out(good_.size());
  EXPECT_THAT(codec_->DecompressAccumulateRecompress(plan_, chunk_, full, FloatSource(values_), absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("one more does not fit")));
}

INSTANTIATE_TEST_SUITE_P(AllMx, MalformedTest, ::testing::ValuesIn(kMxIds),
                         [](const ::testing::TestParamInfo<CodecId>& info) {
                           return std::string(CodecName(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// A ring of 8 ranks by hand: rank 0 compresses, ranks 1..7 DAR with their local values. Each hop's
// error stays within half an ulp of its block scale (or saturation), and the end-to-end error is
// bounded by the sum of the hops' errors.
TEST(MxCodecTest, EightRankRing) {
  constexpr int kRanks = 8;
  constexpr size_t kCount = 4096 + 40;
  std::mt19937 rng(99);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> local(kRanks, std::vector<float>(kCount));
  for (int r = 0; r < kRanks; ++r) {
    for (size_t i = 0; i < kCount; ++i) local[r][i] = normal(rng) * (1.0f + 0.1f * r) * (i % 512 < 32 ? 100.0f : 1.0f);
  }
  std::vector<double> exact(kCount, 0.0);
  for (int r = 0; r < kRanks; ++r) {
    for (size_t i = 0; i < kCount; ++i) exact[i] += local[r][i];
  }
  double exact_norm = 0;
  for (double x : exact) exact_norm += x * x;
  exact_norm = sqrt(exact_norm);

  // Relative L2 error limits of the decoded sum, about 1.5x the observed 0.053 / 0.105 / 0.20 (one
  // E4M3 rounding alone costs ~2.5% RMS; 8 hops on growing partial sums roughly double that).
  const struct {
    CodecId id;
    double limit;
  } cases[] = {{CodecId::kMxfp8, 0.08}, {CodecId::kMxfp6, 0.16}, {CodecId::kMxfp4, 0.3}};
  for (const auto& c : cases) {
    SCOPED_TRACE(CodecName(c.id));
    auto codec = MakeCodec(c.id);
    const MxElementFormat f = MxFormatForBits(BitsOf(c.id));
    const BucketPlan plan = MakePlan(*codec, kCount);
    const ChunkRef chunk{0, 0, kCount};
    std::vector<uint8_t> msg = MustCompress(*codec, plan, chunk, FloatSource(local[0]));
    std::vector<float> decoded = MustDecompress(*codec, plan, chunk, msg);
    double hop_error_sum = 0;
    {
      double e = 0;
      for (size_t i = 0; i < kCount; ++i) e += pow(static_cast<double>(decoded[i]) - local[0][i], 2);
      hop_error_sum += sqrt(e);
    }
    for (int r = 1; r < kRanks; ++r) {
      std::vector<float> sum(kCount);  // what the DAR quantizes: fp32 decode + local
      for (size_t i = 0; i < kCount; ++i) sum[i] = decoded[i] + local[r][i];
      msg = MustDar(*codec, plan, chunk, msg, FloatSource(local[r]));
      decoded = MustDecompress(*codec, plan, chunk, msg);
      double e = 0;
      for (size_t i = 0; i < kCount; ++i) {
        const uint8_t scale = msg[kChunkHeaderBytes + (i / kMxBlockSize) * MxBlockBytes(f.bits)];
        ASSERT_TRUE(WithinHalfUlp(f, scale, sum[i], decoded[i])) << "rank " << r << " element " << i;
        e += pow(static_cast<double>(decoded[i]) - sum[i], 2);
      }
      hop_error_sum += sqrt(e);
    }
    EXPECT_EQ(ParseChunkHeader(msg)->num_summands, kRanks);
    double err = 0;
    for (size_t i = 0; i < kCount; ++i) err += pow(decoded[i] - exact[i], 2);
    err = sqrt(err);
    // Triangle inequality over the hops (plus slack for the fp32 additions).
    EXPECT_LE(err, hop_error_sum * (1 + 1e-6) + 1e-5 * exact_norm);
    EXPECT_LE(err / exact_norm, c.limit);
    EXPECT_GT(err / exact_norm, 0.0);
    printf("%s: ring of %d relative L2 error %.4g (sum of hop errors %.4g)\n", std::string(CodecName(c.id)).c_str(),
           kRanks, err / exact_norm, hop_error_sum / exact_norm);
  }
}

}  // namespace
}  // namespace dynamiq::kernels
