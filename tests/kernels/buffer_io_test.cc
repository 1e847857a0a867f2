#include "kernels/cpu/buffer_io.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_registry.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

TEST(BufferIoTest, LoadSubtractsEachSuperGroupsOffsetAndConvertsBf16) {
  std::vector<uint16_t> bf16(600);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = FloatToBf16(static_cast<float>(i % 8));
  const float offsets[] = {0.5f, 1.0f, 2.0f};
  Source src;
  src.data = bf16.data();
  src.dtype = DType::kBFloat16;
  src.first = 100;  // bf16[0] is bucket element 100
  src.subtract_per_group = offsets;
  std::vector<float> out(300);
  LoadSource(src, 250, out.size(), out.data());  // bucket elements 250..549: super-groups 0, 1, 2
  for (size_t i = 0; i < out.size(); ++i) {
    const size_t k = 250 + i;
    EXPECT_EQ(out[i], static_cast<float>((k - 100) % 8) - offsets[k / 256]) << k;
  }
}

TEST(BufferIoTest, StoreAddsOffsetsAndRoundsToBf16) {
  const float offsets[] = {0.0f, 0.25f};
  std::vector<uint16_t> dest(20, 0xffff);
  Dest d;
  d.data = dest.data();
  d.dtype = DType::kBFloat16;
  d.first = 250;
  d.add_per_group = offsets;
  std::vector<float> in(10, 1.0f + 1.0f / 1024);  // rounds to 1.0 in bf16
  StoreDest(d, 252, in.size(), in.data());        // elements 252..261 straddle super-groups 0 and 1
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(dest[2 + i], FloatToBf16(in[i] + offsets[(252 + i) / 256])) << i;
  }
  EXPECT_EQ(dest[0], 0xffff);
  EXPECT_EQ(dest[12], 0xffff);
}

// Regression (found by scripts/test-sanitizers): the engine hands an empty chunk's accumulator,
// an empty std::vector whose data() is null, to LoadSource, which passed it to memcpy. That is
// undefined behaviour even for 0 bytes (UBSan: "null pointer passed as argument 1").
TEST(BufferIoTest, EmptyRangesAcceptNullBuffers) {
  Source src;
  src.first = 512;
  LoadSource(src, 512, 0, nullptr);
  src.dtype = DType::kBFloat16;
  LoadSource(src, 512, 0, nullptr);
  Dest dst;
  dst.first = 512;
  StoreDest(dst, 512, 0, nullptr);
}

// The same path through every codec: an empty chunk at the end of a bucket, with null buffers
// everywhere, as the engine's executor passes them for buckets smaller than the world.
TEST(BufferIoTest, EveryCodecHandlesAnEmptyChunkWithNullBuffers) {
  for (int id = 0; id < kNumCodecs; ++id) {
    CodecConfig config;
    config.id = static_cast<CodecId>(id);
    const CodecInfo& info = GetCodecInfo(config.id);
    config.bits = info.has_bits ? info.default_bits : 4;  // arc_topk: a density
    SCOPED_TRACE(CodecName(config.id));
    auto codec = CreateCodec(config);
    DQ_ASSERT_OK(codec);
    const size_t n = 512;
    std::vector<float> values(n, 0.5f);
    Source whole;
    whole.data = values.data();
    std::vector<float> stats((*codec)->StatsLength(n));
    if (!stats.empty()) (*codec)->ComputeStats(whole, n, stats.data());
    RoundInfo round;
    round.world_size = 2;
    auto plan = (*codec)->MakePlan(round, n, stats, stats);
    DQ_ASSERT_OK(plan);

    ChunkRef chunk;
    chunk.chunk_id = 1;
    chunk.begin = n;
    chunk.count = 0;
    Source empty;
    empty.first = n;
    std::vector<uint8_t> bytes((*codec)->MaxEncodedBytes(*plan, chunk));
    auto written = (*codec)->Compress(*plan, chunk, empty, absl::MakeSpan(bytes));
    DQ_ASSERT_OK(written);
    bytes.resize(*written);
    DQ_EXPECT_OK((*codec)->DecompressAccumulate(*plan, chunk, bytes, nullptr));
    Dest dest;
    dest.first = n;
    DQ_EXPECT_OK((*codec)->Decompress(*plan, chunk, bytes, dest));
    std::vector<uint8_t> out((*codec)->MaxEncodedBytes(*plan, chunk));
    DQ_EXPECT_OK((*codec)->DecompressAccumulateRecompress(*plan, chunk, bytes, empty, absl::MakeSpan(out)));
  }
}

}  // namespace
}  // namespace dynamiq::kernels
