// Kernels declared in server/cuda_reduce_kernels.h. Compiled with dq_cuda_target_options
// (--fmad=false, no flush-to-zero), so every add, multiply and bf16 conversion rounds as the CPU
// path's does.
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/bf16_math.h"
#include "kernels/cuda/reduce_kernels.h"

namespace dynamiq::kernels {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 65535 * 16;  // grid-stride loops cover the rest

unsigned Blocks(uint64_t n) {
  const uint64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? (blocks == 0 ? 1 : blocks) : kMaxBlocks);
}

template <int kBytes>
__device__ __forceinline__ float Load(const void* in, uint64_t i) {
  if constexpr (kBytes == 4) {
    return static_cast<const float*>(in)[i];
  } else {
    return kernels::Bf16ToFloat(static_cast<const uint16_t*>(in)[i]);
  }
}

template <int kBytes>
__global__ void AccumulateKernel(float* __restrict__ sum, const void* __restrict__ in, uint64_t n, bool first) {
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float v = Load<kBytes>(in, i);
    sum[i] = first ? v : sum[i] + v;
  }
}

template <int kBytes>
__global__ void StoreKernel(void* __restrict__ out, const float* __restrict__ sum, uint64_t n, bool scaled,
                            float scale) {
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float v = scaled ? sum[i] * scale : sum[i];
    if constexpr (kBytes == 4) {
      static_cast<float*>(out)[i] = v;
    } else {
      static_cast<uint16_t*>(out)[i] = kernels::FloatToBf16(v);
    }
  }
}

}  // namespace

int AccumulateCuda(float* sum, const void* in, int element_bytes, uint64_t n, bool first, void* stream) {
  if (n == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (element_bytes == 4) {
    AccumulateKernel<4><<<Blocks(n), kThreads, 0, s>>>(sum, in, n, first);
  } else if (element_bytes == 2) {
    AccumulateKernel<2><<<Blocks(n), kThreads, 0, s>>>(sum, in, n, first);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int StoreSumCuda(void* out, int element_bytes, const float* sum, uint64_t n, bool scaled, float scale, void* stream) {
  if (n == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (element_bytes == 4) {
    StoreKernel<4><<<Blocks(n), kThreads, 0, s>>>(out, sum, n, scaled, scale);
  } else if (element_bytes == 2) {
    StoreKernel<2><<<Blocks(n), kThreads, 0, s>>>(out, sum, n, scaled, scale);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace dynamiq::kernels
