// The CUDA kernels of a GPU node's local reduce (server/cuda_device.h): sum the local workers'
// fp32/bf16 regions into an fp32 sum, and write the sum back as fp32 or bf16, scaled when the
// worker averages. Host-only declarations, free of CUDA headers, with kernels/cuda/launch.h's
// conventions: device pointers, `stream` is a cudaStream_t as void*, launches are asynchronous and
// return a cudaError_t value (0 = success). Compiled with the bit-exact float options, so the
// results equal the CPU path's (server/job.cc) bit for bit.
#ifndef DQ_KERNELS_CUDA_REDUCE_KERNELS_H_
#define DQ_KERNELS_CUDA_REDUCE_KERNELS_H_

#include <stddef.h>
#include <stdint.h>

namespace dynamiq::kernels {

// sum[i] = in[i] (first) or sum[i] += in[i], i < n; `in` holds fp32 (element_bytes 4) or bf16
// (element_bytes 2) values.
int AccumulateCuda(float* sum, const void* in, int element_bytes, uint64_t n, bool first, void* stream);

// out[i] = scaled ? sum[i] * scale : sum[i], stored as fp32 (element_bytes 4) or rounded to bf16
// (element_bytes 2, nearest even), i < n.
int StoreSumCuda(void* out, int element_bytes, const float* sum, uint64_t n, bool scaled, float scale, void* stream);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CUDA_REDUCE_KERNELS_H_
