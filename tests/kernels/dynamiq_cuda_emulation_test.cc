// The DynamiQ CUDA kernel bodies (kernels/cuda/dynamiq_cuda_kernels.cuh), compiled by g++ and run
// on emulated warps, against the CPU codec. Runs everywhere: it checks the kernels'
// indexing, barriers and bit-exact results without a GPU (dynamiq_cuda_test.cu runs the same
// checks on the device).
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/cuda/dynamiq_cuda_host.h"
#include "kernels/cuda/dynamiq_cuda_kernels.cuh"
#include "kernels/cuda/launch.h"
#include "tests/kernels/cuda_block_emulator.h"
#include "tests/kernels/dynamiq_cuda_parity.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::CudaBlockEmulator;
using parity::CaseSpec;
using parity::KernelBackend;

// Runs the kernel bodies warp by warp as the launchers in dynamiq_cuda.cu would: `warps` warps in a
// grid-stride loop over the super-groups (encode, decode, DAR), one validation "thread" per
// super-group. Outputs start as garbage.
class EmulatedBackend : public KernelBackend {
 public:
  EmulatedBackend(CudaBlockEmulator::Order order, int warps) : emu_(internal::kWarpLanes, order), warps_(warps) {}

  std::vector<uint8_t> Encode(const DynamiqCudaChunk& c, const LevelTable* tables,
                              const std::vector<float>& values) override {
    const DynamiqDeviceArgs a = Args(c, tables);
    std::vector<uint8_t> out(c.sg_bytes, 0xa5);
    RunGrid([&](CudaBlockEmulator::Block& w, uint64_t first, uint64_t stride) {
      internal::EncodeWarp(w, a, values.data(), out.data(), first, stride);
    });
    return out;
  }

  std::vector<float> Decode(const DynamiqCudaChunk& c, const LevelTable* tables, const std::vector<uint8_t>& sgs,
                            std::vector<float> out, bool accumulate) override {
    const DynamiqDeviceArgs a = Args(c, tables);
    for (uint64_t j = 0; j < DynamiqNumSuperGroups(a.count); ++j) {
      for (int lane = 0; lane < internal::kWarpLanes; ++lane) {
        internal::DecodeLaneTask(a, j, lane, sgs.data(), out.data(), accumulate);
      }
    }
    return out;
  }

  std::vector<uint8_t> Dar(const DynamiqCudaChunk& c, const LevelTable* tables, const std::vector<uint8_t>& in_sgs,
                           const std::vector<float>& local, bool in_place) override {
    const DynamiqDeviceArgs a = Args(c, tables);
    std::vector<uint8_t> out = in_place ? in_sgs : std::vector<uint8_t>(c.sg_bytes, 0xa5);
    const uint8_t* in = in_place ? out.data() : in_sgs.data();
    RunGrid([&](CudaBlockEmulator::Block& w, uint64_t first, uint64_t stride) {
      internal::DarWarp(w, a, in, local.data(), out.data(), first, stride);
    });
    return out;
  }

  int Validate(const DynamiqCudaChunk& c, const LevelTable* tables, const std::vector<uint8_t>& sgs) override {
    const DynamiqDeviceArgs a = Args(c, tables);
    unsigned int bad = 0xffffffffu;  // the kernel's atomicMin over unsigned, from -1
    for (uint64_t j = 0; j < DynamiqNumSuperGroups(a.count); ++j) {
      if (!internal::SgIsValid(a, sgs.data(), j)) bad = std::min(bad, static_cast<unsigned int>(j));
    }
    return static_cast<int>(bad);
  }

 private:
  static DynamiqDeviceArgs Args(const DynamiqCudaChunk& c, const LevelTable* tables) {
    DynamiqDeviceArgs a = c.args;
    a.tables = tables;
    a.widths = c.widths.data();
    a.offsets = c.offsets.data();
    return a;
  }

  void RunGrid(const std::function<void(CudaBlockEmulator::Block&, uint64_t, uint64_t)>& body) {
    for (int w = 0; w < warps_; ++w) {
      EXPECT_TRUE(emu_.RunBlock(
          static_cast<uint32_t>(w),
          [&](CudaBlockEmulator::Block& b) { body(b, static_cast<uint64_t>(w), static_cast<uint64_t>(warps_)); }))
          << "lanes of warp " << w << " diverged";
    }
  }

  CudaBlockEmulator emu_;
  const int warps_;
};

class DynamiqCudaEmulationTest : public ::testing::TestWithParam<CaseSpec> {};

// One warp per super-group, and three warps taking several each.
TEST_P(DynamiqCudaEmulationTest, KernelBodiesMatchCpuCodec) {
  for (auto order : {CudaBlockEmulator::Order::kAscending, CudaBlockEmulator::Order::kRandom}) {
    for (int warps : {11, 3}) {
      SCOPED_TRACE(order == CudaBlockEmulator::Order::kAscending ? "lanes in ascending order" : "random order");
      SCOPED_TRACE(warps);
      EmulatedBackend backend(order, warps);
      parity::CheckParity(backend, GetParam());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, DynamiqCudaEmulationTest, ::testing::ValuesIn(parity::AllCaseSpecs()),
                         [](const ::testing::TestParamInfo<CaseSpec>& info) { return parity::CaseName(info.param); });

// Correlated rounding over more super-groups than one batch of strata (32 per warp): one warp takes
// all 70 of them, two warps 35 each; encode and DAR must still match the CPU codec at every
// rounding-group size.
TEST(DynamiqCudaEmulationLargeTest, StrataBatchesMatchCpuCodec) {
  for (uint32_t rounding_size : {2u, 8u, 32u}) {
    CodecConfig config;
    config.correlated_rounding = true;
    config.seed = 77;
    const DynamiqCodec codec(config, DynamiqCodec::Kernel::kScalar);
    const size_t d = 70 * kSuperGroupSize - 3;
    BucketPlan plan;
    plan.round = RoundInfo{4, 1, rounding_size};
    plan.num_elements = d;
    for (size_t j = 0; j < 70; ++j) plan.widths.push_back(static_cast<uint8_t>(j % 9 == 0 ? 0 : 2 + j % 7));
    std::vector<float> values(d), local(d);
    for (size_t i = 0; i < d; ++i) {
      values[i] = (BitsToUnit(RandomBits(5, static_cast<uint32_t>(i))) - 0.5f) * static_cast<float>(1 + i % 97);
      local[i] = BitsToUnit(RandomBits(6, static_cast<uint32_t>(i))) - 0.5f;
    }
    ChunkRef chunk;
    chunk.count = d;
    chunk.rounding_index = rounding_size - 1;
    chunk.rounding_size = rounding_size;
    chunk.rounding_group = 3;
    auto prepared = PrepareDynamiqCudaChunk(codec, plan, chunk);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    const DynamiqCudaChunk& c = *prepared;
    ASSERT_TRUE(c.args.correlated);
    LevelTable tables[kMaxWidth + 1];
    CopyDynamiqLevelTables(codec, tables);
    const size_t prefix = kChunkHeaderBytes + c.width_map.size();
    std::vector<uint8_t> cpu(codec.MaxEncodedBytes(plan, chunk));
    ASSERT_TRUE(
        codec.Compress(plan, chunk, Source{values.data(), DType::kFloat32, 0, nullptr}, absl::MakeSpan(cpu)).ok());
    const std::vector<uint8_t> cpu_sgs(cpu.begin() + prefix, cpu.end());
    std::vector<uint8_t> cpu_dar(codec.MaxEncodedBytes(plan, chunk));
    auto n = codec.DecompressAccumulateRecompress(plan, chunk, cpu, Source{local.data(), DType::kFloat32, 0, nullptr},
                                                  absl::MakeSpan(cpu_dar));
    ASSERT_TRUE(n.ok()) << n.status();
    const std::vector<uint8_t> cpu_dar_sgs(cpu_dar.begin() + prefix, cpu_dar.begin() + *n);
    for (int warps : {1, 2}) {
      SCOPED_TRACE(absl::StrCat("rounding group of ", rounding_size, ", ", warps, " warps"));
      EmulatedBackend backend(CudaBlockEmulator::Order::kRandom, warps);
      EXPECT_EQ(parity::ByteMismatch(backend.Encode(c, tables, values), cpu_sgs, c), "");
      EXPECT_EQ(parity::ByteMismatch(backend.Dar(c, tables, cpu_sgs, local, false), cpu_dar_sgs, c), "");
    }
  }
}

TEST(CudaBlockEmulatorTest, ShflReadsTheSourceLaneOfTheSameWarp) {
  CudaBlockEmulator emu(64, CudaBlockEmulator::Order::kRandom);
  std::vector<uint32_t> got(64);
  EXPECT_TRUE(emu.RunBlock(0, [&](CudaBlockEmulator::Block& b) {
    got[b.thread()] = b.Shfl(static_cast<uint32_t>(100 + b.thread()), (b.lane() + 3) % 32);
  }));
  for (int t = 0; t < 64; ++t) EXPECT_EQ(got[t], static_cast<uint32_t>(100 + (t & ~31) + (t % 32 + 3) % 32));
}

// The emulator itself: a missing barrier shows up as order-dependent results, and a barrier not
// reached by every thread as divergence.
TEST(CudaBlockEmulatorTest, MissingBarrierGivesOrderDependentResults) {
  auto run = [](CudaBlockEmulator::Order order) {
    CudaBlockEmulator emu(64, order);
    int shared = 0;
    std::vector<int> seen(64);
    EXPECT_TRUE(emu.RunBlock(0, [&](CudaBlockEmulator::Block& b) {
      if (b.thread() == 0) shared = 1;
      seen[b.thread()] = shared;  // racy: no Sync between the write and the reads
      b.Sync();
    }));
    return seen;
  };
  EXPECT_NE(run(CudaBlockEmulator::Order::kAscending), run(CudaBlockEmulator::Order::kDescending));
}

TEST(CudaBlockEmulatorTest, SyncMakesWritesVisibleAndShuffleExchangesLanes) {
  CudaBlockEmulator emu(64, CudaBlockEmulator::Order::kRandom);
  int shared = 0;
  std::vector<int> seen(64), partner(64);
  EXPECT_TRUE(emu.RunBlock(3, [&](CudaBlockEmulator::Block& b) {
    if (b.thread() == 0) shared = static_cast<int>(b.block());
    b.Sync();
    seen[b.thread()] = shared;
    partner[b.thread()] = b.ShflXor(b.thread(), 5);
  }));
  for (int t = 0; t < 64; ++t) {
    EXPECT_EQ(seen[t], 3);
    EXPECT_EQ(partner[t], t ^ 5);
  }
}

TEST(CudaBlockEmulatorTest, DetectsDivergentBarrier) {
  CudaBlockEmulator emu(32, CudaBlockEmulator::Order::kAscending);
  EXPECT_FALSE(emu.RunBlock(0, [](CudaBlockEmulator::Block& b) {
    if (b.thread() == 7) return;  // skips the barrier the others wait at
    b.Sync();
  }));
}

}  // namespace
}  // namespace dynamiq::kernels
