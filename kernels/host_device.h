// DQ_HOST_DEVICE marks per-element math that is compiled both by g++ (CPU codecs, tests) and by
// nvcc (CUDA kernels), so the CPU tests check exactly the arithmetic the GPU runs.
// Headers that use it must stay free of STL and CUDA headers.
#ifndef DQ_KERNELS_HOST_DEVICE_H_
#define DQ_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define DQ_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DQ_HOST_DEVICE inline
#endif

#endif  // DQ_KERNELS_HOST_DEVICE_H_
