// The none and bf16 codecs (kernels/cpu/simple_codecs.h): their one-pass paths over plain fp32
// memory give the same bytes and values as the tiled path that conversions and per-group offsets
// take, and bf16 rounds to nearest even with NaN kept, at every tile boundary.
#include "kernels/cpu/simple_codecs.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_registry.h"
#include "kernels/payload_checksum.h"
#include "kernels/wire_format.h"
#include "tests/kernels/codec_test_util.h"

namespace dynamiq::kernels {
namespace {

using testing::Dst;
using testing::MustCompress;
using testing::MustDar;
using testing::Src;

// FloatToBf16 as it was written before it became a select: round to nearest even, NaN quieted.
uint16_t ReferenceBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

TEST(Bf16MathTest, SelectMatchesTheBranchingReferenceOnEdgeAndSampledBitPatterns) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x00008000u, 0x00018000u, 0x3f808000u, 0x3f818000u,
                                0x7f7fffffu, 0x7f7f8000u, 0x7f800000u, 0xff800000u, 0x7f800001u, 0x7fc00000u,
                                0xffffffffu, 0x7fffffffu, 0x00000001u, 0x807fffffu};
  for (uint64_t u = 0; u <= 0xffffffffull; u += 65521) bits.push_back(static_cast<uint32_t>(u));
  for (uint32_t u : bits) {
    float f;
    std::memcpy(&f, &u, 4);
    ASSERT_EQ(FloatToBf16(f), ReferenceBf16(f)) << std::hex << u;
  }
}

// Values with no negative zero (x + 0.0f turns -0 into +0, which would tell the paths apart for a
// reason that has nothing to do with them), some NaN and infinities, and values that round up to
// infinity in bf16.
std::vector<float> Values(size_t n, int seed) {
  std::vector<float> v = testing::Gaussian(n, seed);
  for (size_t i = 0; i < n; ++i) {
    if (v[i] == 0.0f) v[i] = 1.0f;
    if (i % 997 == 5) v[i] = std::numeric_limits<float>::quiet_NaN();
    if (i % 991 == 7) v[i] = -std::numeric_limits<float>::infinity();
    if (i % 983 == 11) v[i] = 3.3e38f;
  }
  return v;
}

class SimpleCodecPathsTest : public ::testing::TestWithParam<CodecId> {};

TEST_P(SimpleCodecPathsTest, OnePassPathsEqualTheTiledPathAcrossTileBoundaries) {
  CodecConfig config;
  config.id = GetParam();
  auto codec = CreateCodec(config).value();
  for (size_t n : {size_t{1}, size_t{255}, size_t{1023}, size_t{1024}, size_t{1025}, size_t{5000}}) {
    SCOPED_TRACE(n);
    const size_t first = 300;  // the chunk starts inside the bucket
    const std::vector<float> a = Values(first + n, 1), b = Values(first + n, 2);
    const std::vector<float> zeros((first + n) / 256 + 2, 0.0f);
    BucketPlan plan = codec->MakePlan(RoundInfo{7, 0, 2, 0}, first + n, {}, {}).value();
    ChunkRef chunk;
    chunk.begin = first;
    chunk.count = n;
    // A zero per-group offset sends the codec down the tiled path with the same values.
    Source plain_a = Src(a), plain_b = Src(b), tiled_a = Src(a), tiled_b = Src(b);
    tiled_a.subtract_per_group = zeros.data();
    tiled_b.subtract_per_group = zeros.data();
    const std::vector<uint8_t> sent = MustCompress(*codec, plan, chunk, plain_a);
    EXPECT_EQ(sent, MustCompress(*codec, plan, chunk, tiled_a));
    const std::vector<uint8_t> summed = MustDar(*codec, plan, chunk, sent, plain_b);
    EXPECT_EQ(summed, MustDar(*codec, plan, chunk, sent, tiled_b));
    std::vector<float> plain_out(first + n, -1.0f), tiled_out(first + n, -1.0f);
    Dest tiled = Dst(tiled_out);
    tiled.add_per_group = zeros.data();
    ASSERT_TRUE(codec->Decompress(plan, chunk, summed, Dst(plain_out)).ok());
    ASSERT_TRUE(codec->Decompress(plan, chunk, summed, tiled).ok());
    EXPECT_EQ(std::memcmp(plain_out.data(), tiled_out.data(), 4 * (first + n)), 0);
    // The checksummed and verified variants (one pass) on both paths: the same bytes and values.
    const uint64_t sent_sum = PayloadChecksum(sent), summed_sum = PayloadChecksum(summed);
    for (const Source* src : {&plain_b, &tiled_b}) {
      std::vector<uint8_t> again(summed.size());
      uint64_t sum = 0;
      auto bytes =
          codec->DecompressAccumulateRecompressVerified(plan, chunk, sent, sent_sum, *src, absl::MakeSpan(again), sum);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      EXPECT_EQ(*bytes, summed.size());
      EXPECT_EQ(again, summed);
      EXPECT_EQ(sum, summed_sum);
      EXPECT_EQ(codec->CompressChecksummed(plan, chunk, *src, absl::MakeSpan(again), sum).value(), sent.size());
      EXPECT_EQ(sum, PayloadChecksum(again));
    }
    for (bool tiled_path : {false, true}) {
      std::vector<float> verified(first + n, -1.0f);
      Dest d = Dst(verified);
      if (tiled_path) d.add_per_group = zeros.data();
      ASSERT_TRUE(codec->DecompressVerified(plan, chunk, summed, d, summed_sum).ok());
      EXPECT_EQ(std::memcmp(verified.data(), plain_out.data(), 4 * (first + n)), 0);
      EXPECT_EQ(codec->DecompressVerified(plan, chunk, summed, d, summed_sum + 1).code(), absl::StatusCode::kDataLoss);
    }
    // And the sums are what the format says: a + b rounded once (bf16: each input rounded first).
    for (size_t i = 0; i < n; ++i) {
      const size_t k = first + i;
      float want = a[k] + b[k];
      if (GetParam() == CodecId::kBf16) want = Bf16ToFloat(FloatToBf16(Bf16ToFloat(FloatToBf16(a[k])) + b[k]));
      const float got = plain_out[k];
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << k;
      } else {
        ASSERT_EQ(got, want) << k;
      }
    }
    EXPECT_EQ(plain_out[first - 1], -1.0f);  // nothing outside the chunk
  }
}

// none's split messages (Codec::BodyIsFloat32): the header and the values kept elsewhere are the
// bytes, and have the checksum, of the whole message; a bad header or checksum fails as a whole one.
TEST(SimpleCodecSplitTest, NoneSplitMessagesAreTheWholeMessagesBytes) {
  CodecConfig config;
  config.id = CodecId::kNone;
  auto codec = CreateCodec(config).value();
  ASSERT_TRUE(codec->BodyIsFloat32());
  for (size_t n : {size_t{0}, size_t{1}, size_t{1025}, size_t{5000}}) {
    SCOPED_TRACE(n);
    const size_t first = 300;
    std::vector<float> a = Values(first + n, 1), b = Values(first + n, 2);
    BucketPlan plan = codec->MakePlan(RoundInfo{7, 0, 2, 0}, first + n, {}, {}).value();
    ChunkRef chunk;
    chunk.chunk_id = 1;
    chunk.begin = first;
    chunk.count = n;
    const std::vector<uint8_t> sent = MustCompress(*codec, plan, chunk, Src(a));
    std::vector<uint8_t> head(kChunkHeaderBytes);
    ASSERT_TRUE(codec->WriteFloat32Head(plan, chunk, absl::MakeSpan(head)).ok());
    EXPECT_TRUE(std::equal(head.begin(), head.end(), sent.begin()));
    EXPECT_EQ(std::memcmp(sent.data() + kChunkHeaderBytes, a.data() + first, 4 * n), 0);
    EXPECT_TRUE(codec->CheckFloat32Head(plan, chunk, head).ok());
    ChunkRef other = chunk;
    other.chunk_id = 2;
    EXPECT_EQ(codec->CheckFloat32Head(plan, other, head).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(codec->CheckFloat32Head(plan, chunk, absl::MakeSpan(head).first(20)).code(), absl::StatusCode::kDataLoss);

    const std::vector<uint8_t> summed = MustDar(*codec, plan, chunk, sent, Src(b));
    const uint64_t sent_sum = PayloadChecksum(sent);
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(in_place);
      std::vector<float> local = b, separate(first + n, -1.0f);
      float* body = in_place ? local.data() + first : separate.data() + first;  // in place: the input itself
      std::vector<uint8_t> summed_head(kChunkHeaderBytes);
      uint64_t sum = 0;
      ASSERT_TRUE(codec
                      ->DecompressAccumulateRecompressSplit(plan, chunk, sent, sent_sum, Src(local),
                                                            absl::MakeSpan(summed_head), body, sum)
                      .ok());
      EXPECT_TRUE(std::equal(summed_head.begin(), summed_head.end(), summed.begin()));
      EXPECT_EQ(std::memcmp(body, summed.data() + kChunkHeaderBytes, 4 * n), 0);
      EXPECT_EQ(sum, PayloadChecksum(summed));
      EXPECT_EQ(codec
                    ->DecompressAccumulateRecompressSplit(plan, chunk, sent, sent_sum + 1, Src(b),
                                                          absl::MakeSpan(summed_head), separate.data() + first, sum)
                    .code(),
                absl::StatusCode::kDataLoss);
    }
  }
  config.id = CodecId::kBf16;
  auto bf16 = CreateCodec(config).value();
  EXPECT_FALSE(bf16->BodyIsFloat32());
  std::vector<uint8_t> head(kChunkHeaderBytes);
  EXPECT_EQ(bf16->WriteFloat32Head(BucketPlan{}, ChunkRef{}, absl::MakeSpan(head)).code(),
            absl::StatusCode::kUnimplemented);
}

INSTANTIATE_TEST_SUITE_P(NoneAndBf16, SimpleCodecPathsTest, ::testing::Values(CodecId::kNone, CodecId::kBf16),
                         [](const auto& info) { return std::string(CodecName(info.param)); });

}  // namespace
}  // namespace dynamiq::kernels
