// dynamiq-cuda-kernels-bench: GB/s (of fp32 input) of the DynamiQ CUDA kernels on one GPU, next to
// a device-to-device copy of the same fp32 buffer measured in the same run, and each kernel's
// ratio to that copy (the copy reads and writes 4 bytes per element; compress reads 4 and writes
// ~b/8, so a well-fed kernel can approach or pass the copy's rate).
//
// Data and widths as `dynamiq-kernels-bench --bits` (dynamiq-bench codec's synthetic gradients,
// the allocator's mix of widths at each budget): compress (encode worker 0), validate and
// decompress (worker 1's message), and the fused DAR (worker 1's message + worker 0's values,
// re-encoded out of place). Each budget is measured with independent rounding (--rounding 1) and
// with correlated rounding in rounding groups of each other --rounding size (the chunk's stratum
// comes from the group's permutation, as on a ring of that many ranks). Times are CUDA-event times
// of back-to-back launches on one stream; best and median of --reps. Each row also says whether
// the GPU's bytes equal the CPU codec's (they must: the kernels share kernels/dynamiq_math.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench/synthetic_gradients.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/cuda/dynamiq_cuda_host.h"
#include "kernels/cuda/launch.h"
#include "kernels/wire_format.h"

ABSL_FLAG(int64_t, size, int64_t{1} << 24, "Elements per chunk (default 16M: 64 MiB of fp32).");
ABSL_FLAG(double, min_time, 0.05, "Seconds per measurement.");
ABSL_FLAG(int, reps, 5, "Repetitions per measurement (best and median are printed).");
ABSL_FLAG(std::vector<std::string>, bits, std::vector<std::string>({"4", "5", "6"}), "DynamiQ bit budgets to measure.");
ABSL_FLAG(std::vector<std::string>, rounding, std::vector<std::string>({"1", "8", "32"}),
          "Rounding-group sizes: 1 is independent rounding, n > 1 correlated rounding among n ranks.");
ABSL_FLAG(int, device, 0, "CUDA device.");

namespace dynamiq::bench {
namespace {

using namespace dynamiq::kernels;  // NOLINT: a benchmark of this one module

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "dynamiq-cuda-kernels-bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void Check(int e, const char* what) { Check(static_cast<cudaError_t>(e), what); }

// A device allocation freed on scope exit.
class DeviceMemory {
 public:
  explicit DeviceMemory(size_t bytes) { Check(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), "cudaMalloc"); }
  ~DeviceMemory() { cudaFree(ptr_); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  template <typename T>
  void Upload(const T* host, size_t count) {
    Check(cudaMemcpy(ptr_, host, count * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }

 private:
  void* ptr_ = nullptr;
};

// Seconds per call of `launch` (which queues work on `stream`): best and median of --reps timings
// of back-to-back calls lasting at least --min_time each, by CUDA events.
template <typename Fn>
std::pair<double, double> Time(cudaStream_t stream, Fn&& launch) {
  cudaEvent_t begin, end;
  Check(cudaEventCreate(&begin), "cudaEventCreate");
  Check(cudaEventCreate(&end), "cudaEventCreate");
  auto seconds_for = [&](int calls) {
    Check(cudaEventRecord(begin, stream), "cudaEventRecord");
    for (int i = 0; i < calls; ++i) launch();
    Check(cudaEventRecord(end, stream), "cudaEventRecord");
    Check(cudaEventSynchronize(end), "kernel");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, begin, end), "cudaEventElapsedTime");
    return ms / 1e3;
  };
  seconds_for(1);  // warm-up
  const double once = std::max(seconds_for(1), 1e-6);
  const int calls = std::clamp(static_cast<int>(absl::GetFlag(FLAGS_min_time) / once), 1, 10000);
  std::vector<double> t;
  for (int r = 0; r < std::max(1, absl::GetFlag(FLAGS_reps)); ++r) t.push_back(seconds_for(calls) / calls);
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2]};
}

int Run() {
  if (!CudaDeviceAvailable()) {
    std::printf("dynamiq-cuda-kernels-bench: no CUDA device visible; nothing measured\n");
    return 0;
  }
  Check(cudaSetDevice(absl::GetFlag(FLAGS_device)), "cudaSetDevice");
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, absl::GetFlag(FLAGS_device)), "cudaGetDeviceProperties");
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  const size_t d = static_cast<size_t>(absl::GetFlag(FLAGS_size));
  SyntheticOptions synthetic;
  synthetic.workers = 2;
  synthetic.elements = d;
  const std::vector<std::vector<float>> workers = SyntheticGradients(synthetic);
  DeviceMemory x(d * sizeof(float)), y(d * sizeof(float)), out(d * sizeof(float)), bad(sizeof(int));
  x.Upload(workers[0].data(), d);
  y.Upload(workers[1].data(), d);
  const double gb = 4.0 * static_cast<double>(d) / 1e9;
  auto rate = [gb](std::pair<double, double> t) { return std::make_pair(gb / t.first, gb / t.second); };

  const auto copy = rate(Time(stream, [&] {
    Check(cudaMemcpyAsync(out.as<float>(), x.as<float>(), d * sizeof(float), cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync");
  }));
  std::printf(
      "# dynamiq-cuda-kernels-bench: %s (sm_%d%d), %zu elements (%.0f MiB of fp32); GB/s of fp32 input, "
      "best / median of %d\n",
      prop.name, prop.major, prop.minor, d, 4.0 * static_cast<double>(d) / (1 << 20), absl::GetFlag(FLAGS_reps));
  std::printf("copy: device-to-device copy of the fp32 buffer %.1f / %.1f GB/s (%.1f GB/s of memory traffic)\n",
              copy.first, copy.second, 2 * copy.first);
  std::printf("%5s %4s %8s %15s %15s %15s %15s   %s   %s\n", "bits", "n", "wire b/c", "compress", "validate",
              "decompress", "DAR", "best / copy: compress validate decompress DAR", "GPU bytes == CPU codec");
  bool all_equal = true;
  for (const std::string& budget : absl::GetFlag(FLAGS_bits)) {
    for (const std::string& rounding : absl::GetFlag(FLAGS_rounding)) {
      const uint32_t n = static_cast<uint32_t>(std::max(1, std::atoi(rounding.c_str())));
      CodecConfig config;
      config.bits = std::atof(budget.c_str());
      config.correlated_rounding = n > 1;
      const DynamiqCodec codec(config, DynamiqCodec::Kernel::kSimd);
      std::vector<float> stats(codec.StatsLength(d));
      codec.ComputeStats(Source{workers[0].data(), DType::kFloat32, 0, nullptr}, d, stats.data());
      auto plan = codec.MakePlan(RoundInfo{7, 0, std::max(n, 2u)}, d, stats, stats);
      if (!plan.ok()) {
        std::fprintf(stderr, "--bits=%s: %s\n", budget.c_str(), plan.status().ToString().c_str());
        return 2;
      }
      ChunkRef chunk{0, 0, d};
      chunk.rounding_index = n - 1;  // the last rank of the group: the longest walk of the permutation
      chunk.rounding_size = n;
      chunk.rounding_group = 1;
      auto prepared = PrepareDynamiqCudaChunk(codec, *plan, chunk);
      if (!prepared.ok()) {
        std::fprintf(stderr, "--bits=%s: %s\n", budget.c_str(), prepared.status().ToString().c_str());
        return 1;
      }
      DynamiqCudaChunk& c = *prepared;
      if (c.args.correlated != (n > 1)) {
        std::fprintf(stderr, "--rounding=%u: the chunk's rounding is not what was asked for\n", n);
        return 2;
      }
      LevelTable tables[kMaxWidth + 1];
      CopyDynamiqLevelTables(codec, tables);
      DeviceMemory tables_d(sizeof(tables)), widths_d(c.widths.size()), offsets_d(c.offsets.size() * sizeof(uint64_t));
      tables_d.Upload(tables, kMaxWidth + 1);
      widths_d.Upload(c.widths.data(), c.widths.size());
      offsets_d.Upload(c.offsets.data(), c.offsets.size());
      c.args.tables = tables_d.as<LevelTable>();
      c.args.widths = widths_d.as<uint8_t>();
      c.args.offsets = offsets_d.as<uint64_t>();
      DeviceMemory message(c.sg_bytes), encoded(c.sg_bytes);
      Check(DynamiqEncodeCuda(c.args, y.as<float>(), message.as<uint8_t>(), stream), "encode");

      const auto compress = rate(Time(
          stream, [&] { Check(DynamiqEncodeCuda(c.args, x.as<float>(), encoded.as<uint8_t>(), stream), "encode"); }));
      const auto validate = rate(Time(stream, [&] {
        Check(DynamiqValidateCuda(c.args, message.as<uint8_t>(), bad.as<int>(), stream), "validate");
      }));
      const auto decompress = rate(Time(stream, [&] {
        Check(DynamiqDecodeCuda(c.args, message.as<uint8_t>(), out.as<float>(), false, stream), "decode");
      }));
      const auto dar = rate(Time(stream, [&] {
        Check(DynamiqDarCuda(c.args, message.as<uint8_t>(), x.as<float>(), encoded.as<uint8_t>(), stream), "DAR");
      }));

      // The GPU's encoding of worker 0 against the CPU codec's.
      Check(DynamiqEncodeCuda(c.args, x.as<float>(), encoded.as<uint8_t>(), stream), "encode");
      std::vector<uint8_t> gpu(c.sg_bytes);
      Check(cudaMemcpyAsync(gpu.data(), encoded.as<uint8_t>(), c.sg_bytes, cudaMemcpyDeviceToHost, stream), "download");
      Check(cudaStreamSynchronize(stream), "download");
      std::vector<uint8_t> cpu(codec.MaxEncodedBytes(*plan, chunk));
      const bool compressed =
          codec.Compress(*plan, chunk, Source{workers[0].data(), DType::kFloat32, 0, nullptr}, absl::MakeSpan(cpu))
              .ok();
      const size_t prefix = kChunkHeaderBytes + c.width_map.size();
      const bool equal = compressed && cpu.size() == prefix + c.sg_bytes &&
                         std::memcmp(cpu.data() + prefix, gpu.data(), c.sg_bytes) == 0;
      all_equal &= equal;
      const double wire_bits = 8.0 * static_cast<double>(c.total_bytes()) / static_cast<double>(d);
      std::printf(
          "%5s %4u %8.3f %7.1f /%6.1f %7.1f /%6.1f %7.1f /%6.1f %7.1f /%6.1f   %11.2f %8.2f %10.2f %4.2f   %s\n",
          budget.c_str(), n, wire_bits, compress.first, compress.second, validate.first, validate.second,
          decompress.first, decompress.second, dar.first, dar.second, compress.first / copy.first,
          validate.first / copy.first, decompress.first / copy.first, dar.first / copy.first, equal ? "yes" : "NO");
    }
  }
  cudaStreamDestroy(stream);
  return all_equal ? 0 : 1;
}

}  // namespace
}  // namespace dynamiq::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "dynamiq-cuda-kernels-bench [--size=N] [--bits=4,5,6] [--rounding=1,8,32] [--reps=R] [--min_time=S] "
      "[--device=D]: GB/s of the DynamiQ CUDA kernels (compress, validate, decompress, fused DAR) at each bit "
      "budget, with independent and correlated rounding (groups of --rounding ranks), next to a "
      "device-to-device copy of the same buffer, the ratios, and whether the GPU's bytes equal the CPU codec's "
      "(exit status 1 if not; 0 with a message and nothing measured where no CUDA device is visible).");
  absl::ParseCommandLine(argc, argv);
  return dynamiq::bench::Run();
}
