// kernels/payload_checksum.h: the streaming checksummer gives PayloadChecksum of the whole for any
// split of the bytes, and every codec's *Checksummed encoders return PayloadChecksum of what they
// wrote (none and bf16 compute it while they write).
#include "kernels/payload_checksum.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_info.h"
#include "kernels/codec_registry.h"
#include "kernels/parallel_codec.h"
#include "tests/kernels/codec_test_util.h"

namespace dynamiq::kernels {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

TEST(PayloadChecksummerTest, AnySplitGivesTheOneShotChecksum) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{1000}, size_t{4133}}) {
    const std::vector<uint8_t> b = Bytes(n, static_cast<uint32_t>(n));
    const uint64_t want = PayloadChecksum(b);
    std::mt19937 rng(7);
    for (int trial = 0; trial < 20; ++trial) {
      PayloadChecksummer summer;
      size_t at = 0;
      while (at < n) {
        const size_t piece = std::min<size_t>(n - at, rng() % 150);
        summer.Update(absl::MakeConstSpan(b).subspan(at, piece));
        at += piece;
      }
      ASSERT_EQ(summer.Finish(), want) << "n " << n << " trial " << trial;
    }
  }
  PayloadChecksummer empty;
  EXPECT_EQ(empty.Finish(), PayloadChecksum({}));
  // An empty piece (a split message without a body: a null span) between others changes nothing.
  const std::vector<uint8_t> b = Bytes(100, 3);
  PayloadChecksummer summer;
  summer.Update(absl::MakeConstSpan(b).first(33));
  summer.Update(absl::Span<const uint8_t>());
  summer.Update(absl::MakeConstSpan(b).subspan(33));
  summer.Update(absl::Span<const uint8_t>());
  EXPECT_EQ(summer.Finish(), PayloadChecksum(b));
}

TEST(CodecChecksummedTest, EveryCodecsChecksummedEncodersChecksumWhatTheyWrote) {
  common::ThreadPool pool(3);
  for (CodecId id : {CodecId::kNone, CodecId::kBf16, CodecId::kDynamiq, CodecId::kMxfp8, CodecId::kUniform})
    for (bool split : {false, true}) {
      SCOPED_TRACE(absl::StrCat(CodecName(id), split ? " split across 3 threads" : ""));
      CodecConfig config;
      config.id = id;
      config.bits = id == CodecId::kUniform ? 4 : 5;
      auto plain = CreateCodec(config).value();
      ParallelCodec parallel(*plain, &pool);
      const Codec* codec = split ? static_cast<const Codec*>(&parallel) : plain.get();
      const size_t d = 70001;  // DynamiQ splits from 128 super-groups on
      const std::vector<float> a = testing::Gaussian(d, 1), b = testing::Gaussian(d, 2);
      std::vector<float> stats(codec->StatsLength(d)), reduced;
      codec->ComputeStats(testing::Src(a), d, stats.data());
      reduced = stats;
      const BucketPlan plan = codec->MakePlan(RoundInfo{3, 0, 2, 0}, d, stats, reduced).value();
      ChunkRef chunk;
      chunk.count = d;
      std::vector<uint8_t> sent(codec->MaxEncodedBytes(plan, chunk)), summed(sent.size());
      uint64_t sum = 0;
      const size_t n = codec->CompressChecksummed(plan, chunk, testing::Src(a), absl::MakeSpan(sent), sum).value();
      EXPECT_EQ(sum, PayloadChecksum(absl::MakeConstSpan(sent).first(n)));
      EXPECT_EQ(testing::MustCompress(*codec, plan, chunk, testing::Src(a)),
                std::vector<uint8_t>(sent.begin(), sent.begin() + n));
      const size_t m = codec
                           ->DecompressAccumulateRecompressChecksummed(plan, chunk, absl::MakeConstSpan(sent).first(n),
                                                                       testing::Src(b), absl::MakeSpan(summed), sum)
                           .value();
      EXPECT_EQ(sum, PayloadChecksum(absl::MakeConstSpan(summed).first(m)));
    }
}

TEST(CodecVerifiedTest, VerifiedDecodersDecodeAsThePlainOnesAndRefuseABadChecksumWithDataLoss) {
  common::ThreadPool pool(3);
  for (CodecId id : {CodecId::kNone, CodecId::kBf16, CodecId::kDynamiq, CodecId::kMxfp8})
    for (bool split : {false, true}) {
      SCOPED_TRACE(absl::StrCat(CodecName(id), split ? " split across 3 threads" : ""));
      CodecConfig config;
      config.id = id;
      config.bits = 5;
      auto plain = CreateCodec(config).value();
      ParallelCodec parallel(*plain, &pool);
      const Codec* codec = split ? static_cast<const Codec*>(&parallel) : plain.get();
      const size_t d = 70001;
      const std::vector<float> a = testing::Gaussian(d, 3), b = testing::Gaussian(d, 4);
      std::vector<float> stats(codec->StatsLength(d));
      codec->ComputeStats(testing::Src(a), d, stats.data());
      const BucketPlan plan = codec->MakePlan(RoundInfo{5, 0, 2, 0}, d, stats, stats).value();
      ChunkRef chunk;
      chunk.count = d;
      const std::vector<uint8_t> sent = testing::MustCompress(*codec, plan, chunk, testing::Src(a));
      const uint64_t good = PayloadChecksum(sent);
      // Decompress.
      std::vector<float> want(d), got(d);
      ASSERT_TRUE(codec->Decompress(plan, chunk, sent, testing::Dst(want)).ok());
      ASSERT_TRUE(codec->DecompressVerified(plan, chunk, sent, testing::Dst(got), good).ok());
      EXPECT_EQ(std::memcmp(want.data(), got.data(), 4 * d), 0);
      absl::Status bad = codec->DecompressVerified(plan, chunk, sent, testing::Dst(got), good ^ 1);
      EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss) << bad;
      EXPECT_THAT(std::string(bad.message()), ::testing::HasSubstr("failed its checksum"));
      // DAR: the same bytes and checksum as the unverified call; a bad checksum is DATA_LOSS.
      const std::vector<uint8_t> summed = testing::MustDar(*codec, plan, chunk, sent, testing::Src(b));
      std::vector<uint8_t> out(codec->MaxEncodedBytes(plan, chunk));
      uint64_t sum = 0;
      const size_t n = codec
                           ->DecompressAccumulateRecompressVerified(plan, chunk, sent, good, testing::Src(b),
                                                                    absl::MakeSpan(out), sum)
                           .value();
      EXPECT_EQ(std::vector<uint8_t>(out.begin(), out.begin() + n), summed);
      EXPECT_EQ(sum, PayloadChecksum(summed));
      EXPECT_EQ(codec
                    ->DecompressAccumulateRecompressVerified(plan, chunk, sent, good ^ 1, testing::Src(b),
                                                             absl::MakeSpan(out), sum)
                    .status()
                    .code(),
                absl::StatusCode::kDataLoss);
      // A malformed chunk: DATA_LOSS when its checksum is wrong too, the codec's own error when right.
      std::vector<uint8_t> broken = sent;
      broken[0] ^= 0xff;
      EXPECT_EQ(codec->DecompressVerified(plan, chunk, broken, testing::Dst(got), good).code(),
                absl::StatusCode::kDataLoss);
      const absl::Status refused =
          codec->DecompressVerified(plan, chunk, broken, testing::Dst(got), PayloadChecksum(broken));
      EXPECT_FALSE(refused.ok());
      EXPECT_NE(refused.code(), absl::StatusCode::kDataLoss) << refused;
    }
}

}  // namespace
}  // namespace dynamiq::kernels
