// ParallelCodec (kernels/parallel_codec.h) and the codecs' *On calls: one call's work split across
// 1, 2, 3 or 8 threads gives the bytes, values and errors of the plain call on one thread, for
// DynamiQ (which splits into super-group ranges) at every width and odd sizes, and for codecs that
// do not split (which run on the calling thread).
#include "kernels/parallel_codec.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_registry.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/random_math.h"
#include "kernels/wire_format.h"
#include "tests/kernels/codec_test_util.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::IsOk;
using testing::ExpectChunkRejected;

constexpr int kThreadCounts[] = {1, 2, 3, 8};

// Gaussian values with a log-normal scale per super-group (so the allocator mixes widths, 0 included).
std::vector<float> Values(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  const uint32_t key = StreamKey(seed, 0, 0);
  float scale = 1.0f;
  for (size_t i = 0; i < n; ++i) {
    if (i % kSuperGroupSize == 0)
      scale = std::exp(static_cast<float>(RandomBits(key, ~i) >> 8) / 16777216.0f * 16 - 12);
    const double u1 = (RandomBits(key, 2 * i) + 0.5) / 4294967296.0;
    const double u2 = (RandomBits(key, 2 * i + 1) + 0.5) / 4294967296.0;
    v[i] = scale * static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  return v;
}

// Index of the first element whose bits differ (sizes included), or -1.
template <typename T>
long FirstDifference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return static_cast<long>(std::min(a.size(), b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<long>(i);
  }
  return -1;
}

std::vector<uint8_t> Encode(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                            const std::vector<uint8_t>* received = nullptr) {
  std::vector<uint8_t> out(codec.MaxEncodedBytes(plan, chunk), 0xa5);
  absl::StatusOr<size_t> n =
      received == nullptr ? codec.Compress(plan, chunk, local, absl::MakeSpan(out))
                          : codec.DecompressAccumulateRecompress(plan, chunk, *received, local, absl::MakeSpan(out));
  EXPECT_THAT(n, IsOk());
  if (n.ok()) out.resize(*n);
  return out;
}

// Compress, DAR (adding `local` to `other`'s message), Decompress (fp32 and bf16, with the plan's
// offsets) and DecompressAccumulate of `chunk` through `parallel` match `plain` bit for bit.
void ExpectChunkMatches(const Codec& plain, const Codec& parallel, const BucketPlan& plan, const ChunkRef& chunk,
                        const Source& local, const Source& other) {
  SCOPED_TRACE(::testing::Message() << "chunk [" << chunk.begin << ", +" << chunk.count << ")");
  const std::vector<uint8_t> sent = Encode(plain, plan, chunk, other);
  EXPECT_EQ(FirstDifference(Encode(parallel, plan, chunk, other), sent), -1) << "compress";
  const std::vector<uint8_t> dar = Encode(plain, plan, chunk, local, &sent);
  EXPECT_EQ(FirstDifference(Encode(parallel, plan, chunk, local, &sent), dar), -1) << "DAR";

  const float* offsets = plan.mean_sums.empty() ? nullptr : plan.mean_sums.data();
  std::vector<float> want(chunk.count, -1.0f), got(chunk.count, -2.0f);
  DQ_ASSERT_OK(plain.Decompress(plan, chunk, dar, Dest{want.data(), DType::kFloat32, chunk.begin, offsets}));
  DQ_ASSERT_OK(parallel.Decompress(plan, chunk, dar, Dest{got.data(), DType::kFloat32, chunk.begin, offsets}));
  EXPECT_EQ(FirstDifference(got, want), -1) << "decompress";
  std::vector<uint16_t> want16(chunk.count, 1), got16(chunk.count, 2);
  DQ_ASSERT_OK(plain.Decompress(plan, chunk, dar, Dest{want16.data(), DType::kBFloat16, chunk.begin, offsets}));
  DQ_ASSERT_OK(parallel.Decompress(plan, chunk, dar, Dest{got16.data(), DType::kBFloat16, chunk.begin, offsets}));
  EXPECT_EQ(FirstDifference(got16, want16), -1) << "decompress to bf16";

  std::vector<float> acc_want = Values(chunk.count, 99), acc_got = acc_want;
  DQ_ASSERT_OK(plain.DecompressAccumulate(plan, chunk, dar, acc_want.data()));
  DQ_ASSERT_OK(parallel.DecompressAccumulate(plan, chunk, dar, acc_got.data()));
  EXPECT_EQ(FirstDifference(acc_got, acc_want), -1) << "decompress-accumulate";
}

// The whole bucket as one chunk, and cut into three chunks on super-group boundaries whose
// siblings round in correlated strata (as on a butterfly).
std::vector<ChunkRef> Chunks(size_t d) {
  std::vector<ChunkRef> chunks = {ChunkRef{0, 0, d}};
  const size_t sgs = (d + kSuperGroupSize - 1) / kSuperGroupSize;
  if (sgs >= 3) {
    const size_t a = sgs / 3 * kSuperGroupSize, b = 2 * sgs / 3 * kSuperGroupSize + kSuperGroupSize;
    const size_t cuts[] = {0, a, std::min(b, d), d};
    for (uint32_t c = 0; c < 3; ++c) {
      chunks.push_back(ChunkRef{c + 1, cuts[c], cuts[c + 1] - cuts[c], c % 2, 2, 7});
    }
  }
  return chunks;
}

struct DynamiqCase {
  size_t d;
  double bits;
  DynamiqCodec::Kernel kernel;
  bool bf16_source;
};

class DynamiqSplitTest : public ::testing::TestWithParam<DynamiqCase> {};

TEST_P(DynamiqSplitTest, EveryThreadCountGivesTheBytesAndValuesOfOneThread) {
  const DynamiqCase c = GetParam();
  CodecConfig config;
  config.bits = c.bits;
  const DynamiqCodec codec(config, c.kernel);
  const std::vector<float> x = Values(c.d, 1), y = Values(c.d, 2);
  std::vector<uint16_t> x16(c.d), y16(c.d);
  for (size_t i = 0; i < c.d; ++i) x16[i] = FloatToBf16(x[i]), y16[i] = FloatToBf16(y[i]);
  const DType dtype = c.bf16_source ? DType::kBFloat16 : DType::kFloat32;
  const void* xd = c.bf16_source ? static_cast<const void*>(x16.data()) : x.data();
  const void* yd = c.bf16_source ? static_cast<const void*>(y16.data()) : y.data();

  std::vector<float> stats(codec.StatsLength(c.d));
  codec.ComputeStats(Source{xd, dtype, 0, nullptr}, c.d, stats.data());
  absl::StatusOr<BucketPlan> plan = codec.MakePlan(RoundInfo{11, 1, 4}, c.d, stats, stats);
  ASSERT_THAT(plan, IsOk());
  if (c.d > 100000) {
    // Mixed widths (0 among them), so ranges start after super-groups of different sizes.
    const std::set<uint8_t> widths(plan->widths.begin(), plan->widths.end());
    EXPECT_GE(widths.size(), 3u);
  }
  const Source local{xd, dtype, 0, plan->local_means.data()}, other{yd, dtype, 0, plan->local_means.data()};
  for (int threads : kThreadCounts) {
    SCOPED_TRACE(::testing::Message() << threads << " threads");
    common::ThreadPool pool(threads);
    const ParallelCodec parallel(codec, &pool);
    std::vector<float> split_stats(stats.size(), -1.0f);
    parallel.ComputeStats(Source{xd, dtype, 0, nullptr}, c.d, split_stats.data());
    EXPECT_EQ(FirstDifference(split_stats, stats), -1) << "statistics";
    for (const ChunkRef& chunk : Chunks(c.d)) ExpectChunkMatches(codec, parallel, *plan, chunk, local, other);
    // Chunks of at least 2 * 64 super-groups were split (so the checks above compared something).
    if (threads > 1 && c.d >= 2 * DynamiqCodec::kMinSuperGroupsPerThread * kSuperGroupSize) {
      EXPECT_GT(pool.split_calls(), 0u);
    } else {
      EXPECT_EQ(pool.split_calls(), 0u);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SizesBitsKernels, DynamiqSplitTest,
                         ::testing::Values(DynamiqCase{1, 5, DynamiqCodec::Kernel::kSimd, false},
                                           DynamiqCase{255, 5, DynamiqCodec::Kernel::kSimd, false},
                                           DynamiqCase{257, 4, DynamiqCodec::Kernel::kSimd, false},
                                           DynamiqCase{300001, 3, DynamiqCodec::Kernel::kSimd, false},
                                           DynamiqCase{300001, 5, DynamiqCodec::Kernel::kSimd, false},
                                           DynamiqCase{300001, 8, DynamiqCodec::Kernel::kSimd, false},
                                           DynamiqCase{300001, 5, DynamiqCodec::Kernel::kSimd, true},
                                           DynamiqCase{300001, 5, DynamiqCodec::Kernel::kScalar, false},
                                           DynamiqCase{65536 + 300, 6, DynamiqCodec::Kernel::kScalar, true}),
                         [](const ::testing::TestParamInfo<DynamiqCase>& info) {
                           const DynamiqCase& c = info.param;
                           return absl::StrCat("d", c.d, "_bits", c.bits,
                                               c.kernel == DynamiqCodec::Kernel::kSimd ? "_simd" : "_scalar",
                                               c.bf16_source ? "_bf16" : "_fp32");
                         });

TEST(DynamiqSplitTest, EveryWidthAtRangeBoundaries) {
  // Widths 0 and 2..8 in a repeating pattern whose period (7) is prime to the range sizes.
  const size_t d = 200 * 1024 + 77;
  const DynamiqCodec codec(CodecConfig{}, DynamiqCodec::Kernel::kSimd);
  BucketPlan plan;
  plan.round = RoundInfo{3, 2, 8};
  plan.num_elements = d;
  const uint8_t pattern[] = {0, 2, 3, 4, 5, 6, 7, 8};
  for (size_t j = 0; j < (d + 255) / 256; ++j) plan.widths.push_back(pattern[(j * 3) % 8]);
  const std::vector<float> x = Values(d, 3), y = Values(d, 4);
  for (int threads : kThreadCounts) {
    SCOPED_TRACE(::testing::Message() << threads << " threads");
    common::ThreadPool pool(threads);
    const ParallelCodec parallel(codec, &pool);
    for (const ChunkRef& chunk : Chunks(d)) {
      ExpectChunkMatches(codec, parallel, plan, chunk, testing::Src(x), testing::Src(y));
    }
  }
}

// A chunk of 1200 super-groups of width 4 whose super-groups `malformed` get an infinite super unit
// and `wrong_width` a width of 7 in the map: every thread count must report what one thread does
// (the first bad super-group in order) and write nothing.
TEST(DynamiqSplitTest, MalformedChunksFailAsOnOneThread) {
  const size_t d = 1200 * 256;
  const DynamiqCodec codec(CodecConfig{}, DynamiqCodec::Kernel::kSimd);
  BucketPlan plan;
  plan.round = RoundInfo{5, 0, 2};
  plan.num_elements = d;
  plan.widths.assign(1200, 4);
  const ChunkRef chunk{0, 0, d};
  const std::vector<float> x = Values(d, 5);
  const std::vector<uint8_t> good = testing::MustCompress(codec, plan, chunk, testing::Src(x));
  const size_t map = kChunkHeaderBytes, sgs = map + 600, sg_bytes = SuperGroupBytes(4, 256);
  auto corrupt = [&](std::vector<size_t> malformed, std::vector<size_t> wrong_width) {
    std::vector<uint8_t> bad = good;
    for (size_t j : malformed) {
      const size_t unit = sgs + (j + 1) * sg_bytes - 2;
      bad[unit] = 0x80, bad[unit + 1] = 0x7f;  // +Inf
    }
    for (size_t j : wrong_width) bad[map + j / 2] ^= static_cast<uint8_t>(0x3 << (4 * (j % 2)));
    return bad;
  };
  struct Case {
    std::vector<uint8_t> bytes;
    std::string error;
  };
  const std::vector<Case> cases = {
      {corrupt({1000}, {}), "super-group 1000 is malformed"},
      {corrupt({1000, 50, 700}, {}), "super-group 50 is malformed"},
      {corrupt({1000}, {900}), "super-group 900 arrived with 7-bit codes, the plan says 4"},
      {corrupt({900}, {1000, 1100}), "super-group 900 is malformed"},
      {corrupt({}, {1199}), "super-group 1199 arrived with 7-bit codes"},
  };
  for (int threads : kThreadCounts) {
    common::ThreadPool pool(threads);
    const ParallelCodec parallel(codec, &pool);
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << threads << " threads, " << c.error);
      std::vector<float> out(d);
      const absl::Status one = codec.Decompress(plan, chunk, c.bytes, testing::Dst(out));
      EXPECT_EQ(parallel.Decompress(plan, chunk, c.bytes, testing::Dst(out)), one);
      ExpectChunkRejected(parallel, plan, chunk, testing::Src(x), c.bytes, absl::StatusCode::kInvalidArgument, c.error);
    }
  }
}

TEST(ParallelCodecTest, CodecsThatDoNotSplitRunOnTheCallingThreadWithTheSameResults) {
  for (CodecId id : {CodecId::kUniform, CodecId::kBf16, CodecId::kMxfp8}) {
    CodecConfig config;
    config.id = id;
    config.bits = 4;
    absl::StatusOr<std::unique_ptr<Codec>> codec = CreateCodec(config);
    ASSERT_THAT(codec, IsOk());
    SCOPED_TRACE((*codec)->Describe());
    common::ThreadPool pool(4);
    const ParallelCodec parallel(**codec, &pool);
    EXPECT_EQ(parallel.id(), id);
    EXPECT_EQ(parallel.Describe(), (*codec)->Describe());
    const size_t d = 100000;
    const std::vector<float> x = Values(d, 6), y = Values(d, 7);
    absl::StatusOr<BucketPlan> plan = (*codec)->MakePlan(RoundInfo{2, 0, 2}, d, {}, {});
    ASSERT_THAT(plan, IsOk());
    for (const ChunkRef& chunk : Chunks(d)) {
      ExpectChunkMatches(**codec, parallel, *plan, chunk, testing::Src(x), testing::Src(y));
    }
    EXPECT_EQ(pool.split_calls(), 0u);
  }
}

// The engine keeps none's message bodies in place through a ParallelCodec too (dynamiqd and
// dynamiq-bench wrap every codec in one).
TEST(ParallelCodecTest, SplitMessagesAreTheWrappedCodecs) {
  CodecConfig config;
  config.id = CodecId::kNone;
  absl::StatusOr<std::unique_ptr<Codec>> codec = CreateCodec(config);
  ASSERT_THAT(codec, IsOk());
  common::ThreadPool pool(2);
  const ParallelCodec parallel(**codec, &pool);
  EXPECT_TRUE(parallel.BodyIsFloat32());
  const size_t d = 1000;
  const std::vector<float> x = Values(d, 6), y = Values(d, 7);
  absl::StatusOr<BucketPlan> plan = (*codec)->MakePlan(RoundInfo{2, 0, 2}, d, {}, {});
  ASSERT_THAT(plan, IsOk());
  ChunkRef chunk;
  chunk.count = d;
  std::vector<uint8_t> head(kChunkHeaderBytes), want(kChunkHeaderBytes);
  ASSERT_THAT(parallel.WriteFloat32Head(*plan, chunk, absl::MakeSpan(head)), IsOk());
  ASSERT_THAT((*codec)->WriteFloat32Head(*plan, chunk, absl::MakeSpan(want)), IsOk());
  EXPECT_EQ(head, want);
  EXPECT_THAT(parallel.CheckFloat32Head(*plan, chunk, head), IsOk());
  const std::vector<uint8_t> sent = testing::MustCompress(**codec, *plan, chunk, testing::Src(x));
  std::vector<float> body(d), want_body(d);
  uint64_t sum = 0, want_sum = 0;
  ASSERT_THAT(parallel.DecompressAccumulateRecompressSplit(*plan, chunk, sent, std::nullopt, testing::Src(y),
                                                           absl::MakeSpan(head), body.data(), sum),
              IsOk());
  ASSERT_THAT((*codec)->DecompressAccumulateRecompressSplit(*plan, chunk, sent, std::nullopt, testing::Src(y),
                                                            absl::MakeSpan(want), want_body.data(), want_sum),
              IsOk());
  EXPECT_EQ(head, want);
  EXPECT_EQ(std::memcmp(body.data(), want_body.data(), 4 * d), 0);
  EXPECT_EQ(sum, want_sum);
}

TEST(ParallelCodecTest, ANullPoolRunsOnTheCallingThread) {
  const DynamiqCodec codec(CodecConfig{}, DynamiqCodec::Kernel::kSimd);
  const ParallelCodec parallel(codec, nullptr);
  const size_t d = 70000;
  BucketPlan plan;
  plan.round = RoundInfo{1, 0, 1};
  plan.num_elements = d;
  plan.widths.assign((d + 255) / 256, 5);
  const std::vector<float> x = Values(d, 8), y = Values(d, 9);
  ExpectChunkMatches(codec, parallel, plan, ChunkRef{0, 0, d}, testing::Src(x), testing::Src(y));
}

// One budget per step asks the codec for its measured per-width errors (no cast to DynamiqCodec,
// which a ParallelCodec is not): DynamiQ answers, wrapped or not; codecs without widths do not.
TEST(CodecCapabilityTest, OnlyDynamiqReportsMeasuredWidthErrorsAndAParallelCodecForwardsThem) {
  common::ThreadPool pool(2);
  for (CodecId id : {CodecId::kDynamiq, CodecId::kNone, CodecId::kMxfp8, CodecId::kThc}) {
    CodecConfig config{id};
    config.bits = GetCodecInfo(id).default_bits;
    absl::StatusOr<std::unique_ptr<Codec>> codec = CreateCodec(config);
    ASSERT_THAT(codec, IsOk());
    const ParallelCodec parallel(**codec, &pool);
    const std::array<double, 9>* errors = (*codec)->MeasuredWidthErrors();
    EXPECT_EQ(errors != nullptr, id == CodecId::kDynamiq) << CodecName(id);
    EXPECT_EQ(parallel.MeasuredWidthErrors(), errors) << CodecName(id);
    if (errors != nullptr) {
      EXPECT_EQ(errors, &static_cast<const DynamiqCodec&>(**codec).width_errors());
      for (int w = 2; w <= 8; w *= 2) EXPECT_GT((*errors)[w], 0.0) << "width " << w;
    }
  }
}

}  // namespace
}  // namespace dynamiq::kernels
