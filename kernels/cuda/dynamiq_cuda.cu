// CUDA kernels of the DynamiQ quantizer and the host launchers declared in kernels/cuda/launch.h.
//
// The kernel bodies live in kernels/cuda/dynamiq_cuda_kernels.cuh (shared with the CPU emulation
// in the tests); this file binds them to CUDA built-ins and launches them. Encode, decode and DAR
// run one warp per super-group at a time in a grid-stride loop, on as many 256-thread blocks as
// the GPU holds at once; validation runs one thread per super-group. The target is compiled with
// --fmad=false, IEEE division and square root and without flush-to-zero, so every float operation
// rounds exactly as on the CPU and GPU bytes equal CPU bytes.
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "kernels/cuda/dynamiq_cuda_kernels.cuh"
#include "kernels/cuda/launch.h"

namespace dynamiq::kernels {
namespace {

using internal::kDynamiqBlockThreads;
using internal::kValidateBlockThreads;
using internal::kWarpLanes;

// The Warp interface of dynamiq_cuda_kernels.cuh on real hardware. Every lane of the warp reaches
// every shuffle (warp-uniform control flow), as a full-mask __shfl_sync requires.
struct CudaWarp {
  __device__ __forceinline__ int lane() const { return static_cast<int>(threadIdx.x % kWarpLanes); }
  __device__ __forceinline__ uint32_t ShflXor(uint32_t v, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
  }
  __device__ __forceinline__ uint32_t Shfl(uint32_t v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
};

// This warp's index in the grid and the number of warps: the grid-stride loop's start and stride.
__device__ __forceinline__ uint64_t WarpIndex() {
  return (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpLanes;
}
__device__ __forceinline__ uint64_t WarpCount() { return static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarpLanes; }

__global__ void __launch_bounds__(kDynamiqBlockThreads)
    DynamiqEncodeKernel(const DynamiqDeviceArgs args, const float* __restrict__ values,
                        uint8_t* __restrict__ payload_sgs) {
  CudaWarp warp;
  internal::EncodeWarp(warp, args, values, payload_sgs, WarpIndex(), WarpCount());
}

// No __restrict__ on in/out: DAR may run in place.
__global__ void __launch_bounds__(kDynamiqBlockThreads)
    DynamiqDarKernel(const DynamiqDeviceArgs args, const uint8_t* in_sgs, const float* __restrict__ local,
                     uint8_t* out_sgs) {
  CudaWarp warp;
  internal::DarWarp(warp, args, in_sgs, local, out_sgs, WarpIndex(), WarpCount());
}

__global__ void __launch_bounds__(kDynamiqBlockThreads)
    DynamiqDecodeKernel(const DynamiqDeviceArgs args, const uint8_t* __restrict__ payload_sgs, float* __restrict__ out,
                        bool accumulate) {
  const int lane = static_cast<int>(threadIdx.x % kWarpLanes);
  const uint64_t num_sg = DynamiqNumSuperGroups(args.count);
  for (uint64_t j = WarpIndex(); j < num_sg; j += WarpCount()) {
    internal::DecodeLaneTask(args, j, lane, payload_sgs, out, accumulate);
  }
}

__global__ void __launch_bounds__(kValidateBlockThreads)
    DynamiqValidateKernel(const DynamiqDeviceArgs args, const uint8_t* __restrict__ payload_sgs, int* bad_sg) {
  const uint64_t j = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= DynamiqNumSuperGroups(args.count)) return;
  // *bad_sg starts at -1 (0xffffffff unsigned), so an unsigned min keeps the first bad index.
  if (!internal::SgIsValid(args, payload_sgs, j)) {
    atomicMin(reinterpret_cast<unsigned int*>(bad_sg), static_cast<unsigned int>(j));
  }
}

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Blocks for `n` work items of `per_block` each; 0 (launch nothing) for no work, -1 past the
// grid limit.
int64_t GridFor(uint64_t n, int per_block) {
  const uint64_t blocks = (n + per_block - 1) / per_block;
  return blocks > static_cast<uint64_t>(INT32_MAX) ? -1 : static_cast<int64_t>(blocks);
}

// Blocks of a grid-stride kernel over `num_sg` super-groups (one per warp per pass): one per SG's
// warp up to as many as the current GPU holds at once, measured once per kernel (correctness never
// depends on the grid; only the balance does).
int64_t GridStrideBlocks(const void* kernel, std::atomic<int>& resident, uint64_t num_sg) {
  const int64_t wanted = GridFor(num_sg, kDynamiqBlockThreads / kWarpLanes);
  if (wanted <= 0) return wanted;
  int blocks = resident.load(std::memory_order_relaxed);
  if (blocks == 0) {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kDynamiqBlockThreads, 0) != cudaSuccess ||
        sms <= 0 || per_sm <= 0) {
      (void)cudaGetLastError();
      return wanted;  // one warp per SG: always correct
    }
    blocks = sms * per_sm;
    resident.store(blocks, std::memory_order_relaxed);
  }
  return wanted < blocks ? wanted : blocks;
}

std::atomic<int> encode_blocks{0}, decode_blocks{0}, dar_blocks{0};

}  // namespace

bool CudaDeviceAvailable() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it so later calls do not report it
    return false;
  }
  return n > 0;
}

const char* CudaErrorString(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

int CudaMalloc(void** ptr, size_t bytes) { return static_cast<int>(cudaMalloc(ptr, bytes)); }

int CudaFree(void* ptr) { return static_cast<int>(cudaFree(ptr)); }

int CudaCopyToDevice(void* dst, const void* host_src, size_t bytes, void* stream) {
  return static_cast<int>(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, AsStream(stream)));
}

int CudaCopyToHost(void* host_dst, const void* src, size_t bytes, void* stream) {
  return static_cast<int>(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, AsStream(stream)));
}

int CudaStreamSynchronize(void* stream) { return static_cast<int>(cudaStreamSynchronize(AsStream(stream))); }

int DynamiqEncodeCuda(const DynamiqDeviceArgs& args, const float* values, uint8_t* payload_sgs, void* stream) {
  const int64_t grid = GridStrideBlocks(reinterpret_cast<const void*>(&DynamiqEncodeKernel), encode_blocks,
                                        DynamiqNumSuperGroups(args.count));
  if (grid <= 0) return grid == 0 ? kCudaSuccess : static_cast<int>(cudaErrorInvalidValue);
  DynamiqEncodeKernel<<<static_cast<unsigned int>(grid), kDynamiqBlockThreads, 0, AsStream(stream)>>>(args, values,
                                                                                                      payload_sgs);
  return static_cast<int>(cudaGetLastError());
}

int DynamiqDecodeCuda(const DynamiqDeviceArgs& args, const uint8_t* payload_sgs, float* out, bool accumulate,
                      void* stream) {
  const int64_t grid = GridStrideBlocks(reinterpret_cast<const void*>(&DynamiqDecodeKernel), decode_blocks,
                                        DynamiqNumSuperGroups(args.count));
  if (grid <= 0) return grid == 0 ? kCudaSuccess : static_cast<int>(cudaErrorInvalidValue);
  DynamiqDecodeKernel<<<static_cast<unsigned int>(grid), kDynamiqBlockThreads, 0, AsStream(stream)>>>(args, payload_sgs,
                                                                                                      out, accumulate);
  return static_cast<int>(cudaGetLastError());
}

int DynamiqDarCuda(const DynamiqDeviceArgs& args, const uint8_t* in_sgs, const float* local, uint8_t* out_sgs,
                   void* stream) {
  const int64_t grid =
      GridStrideBlocks(reinterpret_cast<const void*>(&DynamiqDarKernel), dar_blocks, DynamiqNumSuperGroups(args.count));
  if (grid <= 0) return grid == 0 ? kCudaSuccess : static_cast<int>(cudaErrorInvalidValue);
  DynamiqDarKernel<<<static_cast<unsigned int>(grid), kDynamiqBlockThreads, 0, AsStream(stream)>>>(args, in_sgs, local,
                                                                                                   out_sgs);
  return static_cast<int>(cudaGetLastError());
}

int DynamiqValidateCuda(const DynamiqDeviceArgs& args, const uint8_t* payload_sgs, int* bad_sg, void* stream) {
  cudaError_t err = cudaMemsetAsync(bad_sg, 0xff, sizeof(int), AsStream(stream));  // -1
  if (err != cudaSuccess) return static_cast<int>(err);
  const int64_t grid = GridFor(DynamiqNumSuperGroups(args.count), kValidateBlockThreads);
  if (grid <= 0) return grid == 0 ? kCudaSuccess : static_cast<int>(cudaErrorInvalidValue);
  DynamiqValidateKernel<<<static_cast<unsigned int>(grid), kValidateBlockThreads, 0, AsStream(stream)>>>(
      args, payload_sgs, bad_sg);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace dynamiq::kernels
