// The DynamiQ CUDA kernel bodies (kernels/cuda/dynamiq_cuda_kernels.cuh), compiled by g++ and run
// on an emulated thread block, against the CPU codec. Runs everywhere: it checks the kernels'
// indexing, barriers and bit-exact results without a GPU (dynamiq_cuda_test.cu runs the same
// checks on the device).
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/dynamiq_cuda_kernels.cuh"
#include "kernels/cuda/launch.h"
#include "tests/kernels/cuda_block_emulator.h"
#include "tests/kernels/dynamiq_cuda_parity.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::CudaBlockEmulator;
using parity::CaseSpec;
using parity::KernelBackend;

// Runs the kernel bodies block by block as the launchers in dynamiq_cuda.cu would: grid = one
// block per super-group (encode, decode, DAR), one validation "thread" per super-group. Shared
// memory is filled with garbage before every block, as on a GPU, and outputs start as garbage.
class EmulatedBackend : public KernelBackend {
 public:
  explicit EmulatedBackend(CudaBlockEmulator::Order order) : emu_(internal::kDynamiqBlockThreads, order) {}

  std::vector<uint8_t> Encode(const DynamiqCudaChunk& c, const LevelTable* tables,
                              const std::vector<float>& values) override {
    const DynamiqDeviceArgs a = Args(c, tables);
    std::vector<uint8_t> out(c.sg_bytes, 0xa5);
    RunGrid(a, [&](CudaBlockEmulator::Block& b) { internal::EncodeBlock(b, a, values.data(), out.data(), shared_); });
    return out;
  }

  std::vector<float> Decode(const DynamiqCudaChunk& c, const LevelTable* tables, const std::vector<uint8_t>& sgs,
                            std::vector<float> out, bool accumulate) override {
    const DynamiqDeviceArgs a = Args(c, tables);
    for (uint64_t j = 0; j < DynamiqNumSuperGroups(a.count); ++j) {
      for (int t = 0; t < internal::kDynamiqBlockThreads; ++t) {
        internal::DecodeThread(a, j, t, sgs.data(), out.data(), accumulate);
      }
    }
    return out;
  }

  std::vector<uint8_t> Dar(const DynamiqCudaChunk& c, const LevelTable* tables, const std::vector<uint8_t>& in_sgs,
                           const std::vector<float>& local, bool in_place) override {
    const DynamiqDeviceArgs a = Args(c, tables);
    std::vector<uint8_t> out = in_place ? in_sgs : std::vector<uint8_t>(c.sg_bytes, 0xa5);
    const uint8_t* in = in_place ? out.data() : in_sgs.data();
    RunGrid(a, [&](CudaBlockEmulator::Block& b) { internal::DarBlock(b, a, in, local.data(), out.data(), shared_); });
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

  void RunGrid(const DynamiqDeviceArgs& a, const std::function<void(CudaBlockEmulator::Block&)>& body) {
    for (uint64_t j = 0; j < DynamiqNumSuperGroups(a.count); ++j) {
      memset(&shared_, 0xcd, sizeof(shared_));
      EXPECT_TRUE(emu_.RunBlock(static_cast<uint32_t>(j), body)) << "threads of block " << j << " diverged";
    }
  }

  CudaBlockEmulator emu_;
  internal::DynamiqBlockShared shared_;
};

class DynamiqCudaEmulationTest : public ::testing::TestWithParam<CaseSpec> {};

TEST_P(DynamiqCudaEmulationTest, KernelBodiesMatchCpuCodec) {
  for (auto order : {CudaBlockEmulator::Order::kAscending, CudaBlockEmulator::Order::kRandom}) {
    SCOPED_TRACE(order == CudaBlockEmulator::Order::kAscending ? "threads in ascending order" : "random order");
    EmulatedBackend backend(order);
    parity::CheckParity(backend, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(All, DynamiqCudaEmulationTest, ::testing::ValuesIn(parity::AllCaseSpecs()),
                         [](const ::testing::TestParamInfo<CaseSpec>& info) { return parity::CaseName(info.param); });

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
