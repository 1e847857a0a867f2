// The DynamiQ CUDA kernels (kernels/cuda/launch.h) on a GPU against the CPU codec: encode, decode,
// decode-accumulate, fused DAR and validation must reproduce DynamiqCodec byte for byte and bit for
// bit. Tests that need a device skip without one; dynamiq_cuda_emulation_test.cc runs the same
// checks on the CPU through an emulated thread block.
#include <stdint.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/dynamiq_cuda_host.h"
#include "kernels/cuda/launch.h"
#include "tests/kernels/dynamiq_cuda_parity.h"

namespace dynamiq::kernels {
namespace {

using parity::CaseSpec;
using parity::KernelBackend;

// Records a failed CUDA call as a test failure (the results then mismatch as well).
void Check(int err, const char* what) {
  if (err != kCudaSuccess) ADD_FAILURE() << what << ": " << CudaErrorString(err);
}

// Device memory owned for the duration of one backend call.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) Check(CudaMalloc(&ptr_, bytes_), "cudaMalloc");
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    Upload(host.data());
  }
  DeviceBuffer(const void* host, size_t bytes) : DeviceBuffer(bytes) { Upload(host); }
  ~DeviceBuffer() { Check(CudaFree(ptr_), "cudaFree"); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  template <typename T>
  std::vector<T> Download(size_t n) const {
    std::vector<T> host(n);
    if (n > 0) Check(CudaCopyToHost(host.data(), ptr_, n * sizeof(T), nullptr), "copy to host");
    Check(CudaStreamSynchronize(nullptr), "synchronize");
    return host;
  }

 private:
  void Upload(const void* host) {
    if (bytes_ > 0) Check(CudaCopyToDevice(ptr_, host, bytes_, nullptr), "copy to device");
  }
  size_t bytes_;
  void* ptr_ = nullptr;
};

// Uploads the chunk's tables, widths and offsets and points the launch arguments at them.
class DeviceChunk {
 public:
  DeviceChunk(const DynamiqCudaChunk& c, const LevelTable* tables)
      : tables_(tables, sizeof(LevelTable) * (kMaxWidth + 1)), widths_(c.widths), offsets_(c.offsets), args_(c.args) {
    args_.tables = tables_.get<const LevelTable>();
    args_.widths = widths_.get<const uint8_t>();
    args_.offsets = offsets_.get<const uint64_t>();
  }
  const DynamiqDeviceArgs& args() const { return args_; }

 private:
  DeviceBuffer tables_, widths_, offsets_;
  DynamiqDeviceArgs args_;
};

// Outputs start as garbage so that bytes a kernel fails to write are caught.
class GpuBackend : public KernelBackend {
 public:
  std::vector<uint8_t> Encode(const DynamiqCudaChunk& c, const LevelTable* tables,
                              const std::vector<float>& values) override {
    DeviceChunk dc(c, tables);
    DeviceBuffer in(values), out(std::vector<uint8_t>(c.sg_bytes, 0xa5));
    Check(DynamiqEncodeCuda(dc.args(), in.get<const float>(), out.get<uint8_t>(), nullptr), "encode launch");
    return out.Download<uint8_t>(c.sg_bytes);
  }

  std::vector<float> Decode(const DynamiqCudaChunk& c, const LevelTable* tables, const std::vector<uint8_t>& sgs,
                            std::vector<float> init, bool accumulate) override {
    DeviceChunk dc(c, tables);
    DeviceBuffer in(sgs), out(init);
    Check(DynamiqDecodeCuda(dc.args(), in.get<const uint8_t>(), out.get<float>(), accumulate, nullptr),
          "decode launch");
    return out.Download<float>(init.size());
  }

  std::vector<uint8_t> Dar(const DynamiqCudaChunk& c, const LevelTable* tables, const std::vector<uint8_t>& in_sgs,
                           const std::vector<float>& local, bool in_place) override {
    DeviceChunk dc(c, tables);
    DeviceBuffer in(in_sgs), values(local), out(std::vector<uint8_t>(c.sg_bytes, 0xa5));
    uint8_t* dst = in_place ? in.get<uint8_t>() : out.get<uint8_t>();
    Check(DynamiqDarCuda(dc.args(), in.get<const uint8_t>(), values.get<const float>(), dst, nullptr), "DAR launch");
    return (in_place ? in : out).Download<uint8_t>(c.sg_bytes);
  }

  int Validate(const DynamiqCudaChunk& c, const LevelTable* tables, const std::vector<uint8_t>& sgs) override {
    DeviceChunk dc(c, tables);
    DeviceBuffer in(sgs), bad(std::vector<int>{12345});  // the launcher resets it to -1
    Check(DynamiqValidateCuda(dc.args(), in.get<const uint8_t>(), bad.get<int>(), nullptr), "validate launch");
    return bad.Download<int>(1)[0];
  }
};

class DynamiqCudaTest : public ::testing::TestWithParam<CaseSpec> {
 protected:
  void SetUp() override {
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(DynamiqCudaTest, MatchesCpuCodec) {
  GpuBackend backend;
  parity::CheckParity(backend, GetParam());
}

INSTANTIATE_TEST_SUITE_P(All, DynamiqCudaTest, ::testing::ValuesIn(parity::AllCaseSpecs()),
                         [](const ::testing::TestParamInfo<CaseSpec>& info) { return parity::CaseName(info.param); });

class DynamiqCudaLargeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

// Many blocks: a chunk of 3000 super-groups at mixed widths (validation then spans several
// blocks of its grid, and the first of several bad super-groups must win the atomicMin).
TEST_F(DynamiqCudaLargeTest, ManySuperGroups) {
  CodecConfig config;
  const DynamiqCodec codec(config, DynamiqCodec::Kernel::kScalar);
  const size_t d = 3000 * kSuperGroupSize - 5;
  BucketPlan plan;
  plan.round = RoundInfo{3, 0, 1};
  plan.num_elements = d;
  for (size_t j = 0; j < 3000; ++j) plan.widths.push_back(static_cast<uint8_t>(j % 11 == 0 ? 0 : 2 + j % 7));
  std::vector<float> values(d);
  for (size_t i = 0; i < d; ++i) {
    values[i] = (BitsToUnit(RandomBits(5, static_cast<uint32_t>(i))) - 0.5f) * static_cast<float>(1 + i % 977);
  }
  ChunkRef chunk;
  chunk.count = d;
  auto prepared = PrepareDynamiqCudaChunk(codec, plan, chunk);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  const DynamiqCudaChunk& c = *prepared;
  LevelTable tables[kMaxWidth + 1];
  CopyDynamiqLevelTables(codec, tables);
  std::vector<uint8_t> cpu(codec.MaxEncodedBytes(plan, chunk));
  ASSERT_TRUE(
      codec.Compress(plan, chunk, Source{values.data(), DType::kFloat32, 0, nullptr}, absl::MakeSpan(cpu)).ok());
  const std::vector<uint8_t> cpu_sgs(cpu.begin() + kChunkHeaderBytes + c.width_map.size(), cpu.end());
  GpuBackend gpu;
  EXPECT_EQ(parity::ByteMismatch(gpu.Encode(c, tables, values), cpu_sgs, c), "");
  EXPECT_EQ(gpu.Validate(c, tables, cpu_sgs), -1);
  std::vector<uint8_t> bad = cpu_sgs;
  for (size_t j : {2999u, 2500u, 1000u, 257u}) bad[c.offsets[j] + 2 * c.widths[j]] = 0;  // zero group scales
  EXPECT_EQ(gpu.Validate(c, tables, bad), 257);
}

TEST_F(DynamiqCudaLargeTest, EmptyRunLaunchesNothing) {
  DynamiqDeviceArgs args;  // count 0: no kernels, only the reset of *bad_sg
  DeviceBuffer bad(std::vector<int>{7});
  EXPECT_EQ(DynamiqEncodeCuda(args, nullptr, nullptr, nullptr), kCudaSuccess);
  EXPECT_EQ(DynamiqDecodeCuda(args, nullptr, nullptr, false, nullptr), kCudaSuccess);
  EXPECT_EQ(DynamiqDarCuda(args, nullptr, nullptr, nullptr, nullptr), kCudaSuccess);
  EXPECT_EQ(DynamiqValidateCuda(args, nullptr, bad.get<int>(), nullptr), kCudaSuccess);
  EXPECT_EQ(bad.Download<int>(1)[0], -1);
}

// Runs with or without a device: the runtime probe must answer, never crash.
TEST(DynamiqCudaRuntimeTest, DeviceProbeNeverCrashes) {
  const bool available = CudaDeviceAvailable();
  EXPECT_EQ(CudaDeviceAvailable(), available);
  EXPECT_STREQ(CudaErrorString(kCudaSuccess), "no error");
}

}  // namespace
}  // namespace dynamiq::kernels
