// Kernels declared in engine/nccl_allreduce_kernels.h. Compiled with dq_cuda_target_options
// (--fmad=false, IEEE division and square root, no flush-to-zero), so each float and double
// operation rounds as the CPU codecs' does.
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/bf16_math.h"
#include "kernels/cuda/allreduce_kernels.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::kernels {
namespace {

using kernels::Bf16ToFloat;
using kernels::FloatToBf16;
using kernels::FloatToBf16Up;
using kernels::kSuperGroupSize;
using kernels::SuperGroupMoments;
using kernels::SuperGroupStats;

constexpr int kStatsThreads = 128;
constexpr int kElementThreads = 256;
constexpr uint64_t kMaxElementBlocks = 65535 * 16;  // grid-stride loops cover the rest

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// One thread per super-group, summed in SuperGroupMoments' order, as DynamiqCodec::ComputeStats.
__global__ void __launch_bounds__(kStatsThreads)
    StatsKernel(const float* __restrict__ values, uint64_t count, float* __restrict__ stats) {
  const uint64_t j = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t num_sg = (count + kSuperGroupSize - 1) / kSuperGroupSize;
  if (j >= num_sg) return;
  const uint64_t begin = j * kSuperGroupSize;
  const uint64_t rest = count - begin;
  const int n = rest < static_cast<uint64_t>(kSuperGroupSize) ? static_cast<int>(rest) : kSuperGroupSize;
  // The summation order every device shares (SuperGroupMoments), so GPU and CPU ranks agree bit
  // for bit.
  double sum = 0, sum_sq = 0;
  SuperGroupMoments(values + begin, n, &sum, &sum_sq);
  SuperGroupStats(sum, sum_sq, n, stats + 2 * j);
}

__global__ void CentreKernel(const float* __restrict__ in, const float* __restrict__ means, uint64_t first_sg,
                             uint64_t count, float* __restrict__ out) {
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    out[i] = in[i] - means[first_sg + i / kSuperGroupSize];
  }
}

__global__ void AddMeansKernel(float* __restrict__ out, const float* __restrict__ sums, uint64_t first_sg,
                               uint64_t count) {
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    out[i] = out[i] + sums[first_sg + i / kSuperGroupSize];
  }
}

template <int kBytes>
__device__ __forceinline__ float Load(const uint8_t* payload, uint64_t i) {
  if constexpr (kBytes == 4) {
    return reinterpret_cast<const float*>(payload)[i];
  } else {
    return Bf16ToFloat(reinterpret_cast<const uint16_t*>(payload)[i]);
  }
}

template <int kBytes>
__device__ __forceinline__ void Store(uint8_t* payload, uint64_t i, float v) {
  if constexpr (kBytes == 4) {
    reinterpret_cast<float*>(payload)[i] = v;
  } else {
    reinterpret_cast<uint16_t*>(payload)[i] = FloatToBf16(v);
  }
}

template <int kBytes>
__global__ void SimpleEncodeKernel(const float* __restrict__ values, uint64_t count, uint8_t* __restrict__ payload) {
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    Store<kBytes>(payload, i, values[i]);
  }
}

template <int kBytes>
__global__ void SimpleDecodeKernel(const uint8_t* __restrict__ payload, uint64_t count, float* __restrict__ out,
                                   bool accumulate) {
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float d = Load<kBytes>(payload, i);
    out[i] = accumulate ? out[i] + d : d;
  }
}

// In place: each thread reads and rewrites only its own elements.
template <int kBytes>
__global__ void SimpleDarKernel(uint8_t* payload, const float* __restrict__ local, uint64_t count) {
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    Store<kBytes>(payload, i, Load<kBytes>(payload, i) + local[i]);
  }
}

unsigned int ElementBlocks(uint64_t count) {
  const uint64_t blocks = (count + kElementThreads - 1) / kElementThreads;
  return static_cast<unsigned int>(blocks < kMaxElementBlocks ? blocks : kMaxElementBlocks);
}

}  // namespace

int DynamiqStatsCuda(const float* values, uint64_t count, float* stats, void* stream) {
  const uint64_t num_sg = (count + kSuperGroupSize - 1) / kSuperGroupSize;
  if (num_sg == 0) return cudaSuccess;
  const uint64_t blocks = (num_sg + kStatsThreads - 1) / kStatsThreads;
  if (blocks > static_cast<uint64_t>(INT32_MAX)) return static_cast<int>(cudaErrorInvalidValue);
  StatsKernel<<<static_cast<unsigned int>(blocks), kStatsThreads, 0, AsStream(stream)>>>(values, count, stats);
  return static_cast<int>(cudaGetLastError());
}

int CentreCuda(const float* in, const float* means, uint64_t first_sg, uint64_t count, float* out, void* stream) {
  if (count == 0) return cudaSuccess;
  CentreKernel<<<ElementBlocks(count), kElementThreads, 0, AsStream(stream)>>>(in, means, first_sg, count, out);
  return static_cast<int>(cudaGetLastError());
}

int AddMeansCuda(float* out, const float* sums, uint64_t first_sg, uint64_t count, void* stream) {
  if (count == 0) return cudaSuccess;
  AddMeansKernel<<<ElementBlocks(count), kElementThreads, 0, AsStream(stream)>>>(out, sums, first_sg, count);
  return static_cast<int>(cudaGetLastError());
}

int SimpleEncodeCuda(int element_bytes, const float* values, uint64_t count, uint8_t* payload, void* stream) {
  if (count == 0) return cudaSuccess;
  if (element_bytes == 4) {
    SimpleEncodeKernel<4><<<ElementBlocks(count), kElementThreads, 0, AsStream(stream)>>>(values, count, payload);
  } else if (element_bytes == 2) {
    SimpleEncodeKernel<2><<<ElementBlocks(count), kElementThreads, 0, AsStream(stream)>>>(values, count, payload);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

int SimpleDecodeCuda(int element_bytes, const uint8_t* payload, uint64_t count, float* out, bool accumulate,
                     void* stream) {
  if (count == 0) return cudaSuccess;
  if (element_bytes == 4) {
    SimpleDecodeKernel<4>
        <<<ElementBlocks(count), kElementThreads, 0, AsStream(stream)>>>(payload, count, out, accumulate);
  } else if (element_bytes == 2) {
    SimpleDecodeKernel<2>
        <<<ElementBlocks(count), kElementThreads, 0, AsStream(stream)>>>(payload, count, out, accumulate);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

int SimpleDarCuda(int element_bytes, uint8_t* payload, const float* local, uint64_t count, void* stream) {
  if (count == 0) return cudaSuccess;
  if (element_bytes == 4) {
    SimpleDarKernel<4><<<ElementBlocks(count), kElementThreads, 0, AsStream(stream)>>>(payload, local, count);
  } else if (element_bytes == 2) {
    SimpleDarKernel<2><<<ElementBlocks(count), kElementThreads, 0, AsStream(stream)>>>(payload, local, count);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace dynamiq::kernels
