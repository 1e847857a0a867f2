// The host-side preparation of the DynamiQ CUDA kernels (kernels/cuda/dynamiq_cuda_host.h)
// against DynamiqCodec's own layout and keys. Runs without a GPU.
#include "kernels/cuda/dynamiq_cuda_host.h"

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/dynamiq_math.h"
#include "kernels/random_math.h"
#include "kernels/wire_format.h"
#include "tests/kernels/dynamiq_cuda_parity.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;

struct Shape {
  size_t begin_sg;
  size_t count;
  uint32_t rounding_size;
};

// Checks the layout, prefix and keys of `chunk` against what the codec writes: every super-group
// re-encoded on the host with the prepared keys must reproduce the codec's bytes at its offset.
void CheckAgainstCodec(const DynamiqCodec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                       const std::vector<float>& bucket) {
  auto prepared = PrepareDynamiqCudaChunk(codec, plan, chunk);
  ASSERT_THAT(prepared, IsOk());
  const DynamiqCudaChunk& c = *prepared;
  ASSERT_EQ(c.total_bytes(), codec.MaxEncodedBytes(plan, chunk));
  const Source src{bucket.data(), DType::kFloat32, 0, nullptr};
  std::vector<uint8_t> cpu(c.total_bytes());
  auto n = codec.Compress(plan, chunk, src, absl::MakeSpan(cpu));
  ASSERT_THAT(n, IsOk());
  ASSERT_EQ(*n, c.total_bytes());

  // Header and width map.
  const size_t prefix = kChunkHeaderBytes + c.width_map.size();
  std::vector<uint8_t> mine(prefix, 0xee);
  ASSERT_THAT(WriteDynamiqChunkPrefix(codec, plan, chunk, c, 1, absl::MakeSpan(mine)), IsOk());
  EXPECT_EQ(mine, std::vector<uint8_t>(cpu.begin(), cpu.begin() + prefix));
  // DAR output carries one more summand.
  std::vector<uint8_t> dar(c.total_bytes());
  ASSERT_THAT(codec.DecompressAccumulateRecompress(plan, chunk, cpu, src, absl::MakeSpan(dar)), IsOk());
  ASSERT_THAT(WriteDynamiqChunkPrefix(codec, plan, chunk, c, 2, absl::MakeSpan(mine)), IsOk());
  EXPECT_EQ(mine, std::vector<uint8_t>(dar.begin(), dar.begin() + prefix));
  EXPECT_THAT(WriteDynamiqChunkPrefix(codec, plan, chunk, c, 1, absl::MakeSpan(mine.data(), prefix - 1)),
              StatusIs(absl::StatusCode::kInvalidArgument));

  // Offsets, widths and keys, super-group by super-group.
  const size_t num_sg = (chunk.count + kSuperGroupSize - 1) / kSuperGroupSize;
  ASSERT_EQ(c.widths.size(), num_sg);
  ASSERT_EQ(c.offsets.size(), num_sg);
  EXPECT_EQ(c.args.count, chunk.count);
  EXPECT_EQ(c.args.first_sg, chunk.begin / kSuperGroupSize);
  EXPECT_EQ(c.args.rounding_index, chunk.rounding_index);
  EXPECT_EQ(c.args.rounding_size, chunk.rounding_size);
  EXPECT_EQ(c.args.correlated, codec.config().correlated_rounding && chunk.rounding_size > 1);
  EXPECT_EQ(c.args.tables, nullptr);
  uint64_t expected_offset = 0;
  const uint8_t* sgs = cpu.data() + prefix;
  for (size_t j = 0; j < num_sg; ++j) {
    SCOPED_TRACE(::testing::Message() << "super-group " << j);
    const size_t global_sg = chunk.begin / kSuperGroupSize + j;
    const int w = plan.widths[global_sg];
    const int count = static_cast<int>(std::min<size_t>(kSuperGroupSize, chunk.count - j * kSuperGroupSize));
    EXPECT_EQ(c.widths[j], w);
    EXPECT_EQ(c.offsets[j], expected_offset);
    expected_offset += SuperGroupBytes(w, count);
    if (w == 0) continue;
    const uint32_t stratum = c.args.correlated ? StratumOf(c.args.shared_key, static_cast<uint32_t>(global_sg),
                                                           c.args.rounding_index, c.args.rounding_size)
                                               : 0;
    std::vector<uint8_t> sg(SuperGroupBytes(w, count));
    EncodeSuperGroup(codec.table(w), bucket.data() + global_sg * kSuperGroupSize, count, c.args.key,
                     static_cast<uint32_t>(global_sg * kSuperGroupSize), c.args.correlated, stratum,
                     c.args.rounding_size, sg.data());
    EXPECT_EQ(sg, std::vector<uint8_t>(sgs + c.offsets[j], sgs + c.offsets[j] + sg.size()));
  }
  EXPECT_EQ(c.sg_bytes, expected_offset);
}

TEST(DynamiqCudaHostTest, LayoutAndKeysMatchTheCodec) {
  const std::vector<Shape> shapes = {
      {0, 13 * kSuperGroupSize + 77, 3},  // whole bucket, partial last super-group
      {3, 10 * kSuperGroupSize + 77, 3},  // the parity tests' chunk
      {2, 4 * kSuperGroupSize, 2},        // full super-groups only, mid-bucket
      {13, 77, 4},                        // only the partial super-group
      {5, 1, 1},                          // a single element (the bucket is cut short below)
      {0, 0, 1},                          // empty
  };
  for (LevelKind levels : {LevelKind::kMee, LevelKind::kUniform, LevelKind::kAuto}) {
    for (bool correlated : {false, true}) {
      CodecConfig config;
      config.levels = levels;
      config.correlated_rounding = correlated;
      const DynamiqCodec codec(config, DynamiqCodec::Kernel::kScalar);
      for (const Shape& s : shapes) {
        SCOPED_TRACE(::testing::Message() << "levels " << static_cast<int>(levels) << " correlated " << correlated
                                          << " chunk at super-group " << s.begin_sg << " of " << s.count);
        const size_t d = s.count == 1 ? 5 * kSuperGroupSize + 1 : 13 * kSuperGroupSize + 77;
        BucketPlan plan;
        plan.round = RoundInfo{11, 2, 4};
        plan.num_elements = d;
        for (size_t j = 0; j < (d + kSuperGroupSize - 1) / kSuperGroupSize; ++j) {
          plan.widths.push_back(j % 8 == 1 ? 0 : static_cast<uint8_t>(kMinWidth + j % 7));
        }
        std::vector<float> bucket(d);
        for (size_t i = 0; i < d; ++i) bucket[i] = BitsToUnit(RandomBits(99, static_cast<uint32_t>(i))) - 0.5f;
        ChunkRef chunk;
        chunk.chunk_id = 9;
        chunk.begin = s.begin_sg * kSuperGroupSize;
        chunk.count = s.count;
        chunk.rounding_index = s.rounding_size - 1;
        chunk.rounding_size = s.rounding_size;
        chunk.rounding_group = 17;
        CheckAgainstCodec(codec, plan, chunk, bucket);
      }
    }
  }
}

TEST(DynamiqCudaHostTest, ParityCaseChunkMatchesTheCodec) {
  for (const parity::CaseSpec& spec : parity::AllCaseSpecs()) {
    SCOPED_TRACE(parity::CaseName(spec));
    const parity::ParityCase pc = parity::MakeCase(spec);
    std::vector<float> bucket(pc.plan.num_elements, 0.0f);
    std::copy(pc.local.begin(), pc.local.end(), bucket.begin() + pc.chunk.begin);
    CheckAgainstCodec(*pc.codec, pc.plan, pc.chunk, bucket);
  }
}

TEST(DynamiqCudaHostTest, RejectsWhatTheCodecRejects) {
  const DynamiqCodec codec(CodecConfig{}, DynamiqCodec::Kernel::kScalar);
  BucketPlan plan;
  plan.num_elements = 3 * kSuperGroupSize;
  plan.widths = {4, 4, 4};
  ChunkRef chunk;
  chunk.begin = 100;  // not on a super-group boundary
  chunk.count = 10;
  EXPECT_THAT(PrepareDynamiqCudaChunk(codec, plan, chunk), StatusIs(absl::StatusCode::kInvalidArgument));
  chunk.begin = kSuperGroupSize;
  chunk.count = 2 * kSuperGroupSize + 1;  // past the end
  EXPECT_THAT(PrepareDynamiqCudaChunk(codec, plan, chunk), StatusIs(absl::StatusCode::kInvalidArgument));
  chunk.count = 2 * kSuperGroupSize;
  EXPECT_THAT(PrepareDynamiqCudaChunk(codec, plan, chunk), IsOk());
  plan.widths = {4, 4};  // plan does not cover the bucket
  EXPECT_THAT(PrepareDynamiqCudaChunk(codec, plan, chunk), StatusIs(absl::StatusCode::kInvalidArgument));
  for (uint8_t bad : {1, 9, 15}) {
    plan.widths = {4, 4, bad};
    EXPECT_THAT(PrepareDynamiqCudaChunk(codec, plan, chunk), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

TEST(DynamiqCudaHostTest, CopiesTheCodecsTables) {
  for (LevelKind levels : {LevelKind::kMee, LevelKind::kUniform, LevelKind::kAuto}) {
    CodecConfig config;
    config.levels = levels;
    const DynamiqCodec codec(config, DynamiqCodec::Kernel::kScalar);
    LevelTable tables[kMaxWidth + 1];
    memset(tables, 0x5a, sizeof(tables));
    CopyDynamiqLevelTables(codec, tables);
    const LevelTable zero{};
    for (int w = 0; w < kMinWidth; ++w) EXPECT_EQ(memcmp(&tables[w], &zero, sizeof(LevelTable)), 0);
    for (int w = kMinWidth; w <= kMaxWidth; ++w) {
      EXPECT_EQ(memcmp(&tables[w], &codec.table(w), sizeof(LevelTable)), 0) << "width " << w;
    }
  }
}

}  // namespace
}  // namespace dynamiq::kernels
