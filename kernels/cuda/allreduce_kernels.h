// Small CUDA kernels of the device all-reduce (engine/nccl_allreduce.h) that kernels/cuda does not
// provide: DynamiQ bucket statistics, mean centring and add-back, and the none/bf16 codecs.
// Host-only declarations, free of CUDA headers, with kernels/cuda/launch.h's conventions: device
// pointers, `stream` is a cudaStream_t as void*, launches are asynchronous and return a
// cudaError_t value (0 = success). Every float operation is the one the CPU codecs perform
// (the target is compiled with --fmad=false and IEEE division/square root), so results are
// bit-identical to the CPU engine's.
#ifndef DQ_KERNELS_CUDA_ALLREDUCE_KERNELS_H_
#define DQ_KERNELS_CUDA_ALLREDUCE_KERNELS_H_

#include <stddef.h>
#include <stdint.h>

namespace dynamiq::kernels {

// DynamiqCodec::ComputeStats on the device: for every super-group j of values[0, count),
// stats[2j] = bf16(mean) (0 if not finite) and stats[2j + 1] = bf16-rounded-up L2 norm, from
// sequential double sums in element order (one thread per super-group).
int DynamiqStatsCuda(const float* values, uint64_t count, float* stats, void* stream);

// out[i] = in[i] - means[first_sg + i / 256], i < count (Source::subtract_per_group).
int CentreCuda(const float* in, const float* means, uint64_t first_sg, uint64_t count, float* out, void* stream);

// out[i] = out[i] + sums[first_sg + i / 256], i < count (Dest::add_per_group).
int AddMeansCuda(float* out, const float* sums, uint64_t first_sg, uint64_t count, void* stream);

// The none (element_bytes 4, raw fp32) and bf16 (element_bytes 2, round to nearest even)
// payloads, little-endian, `payload` 4-byte aligned.
// Encode: payload = values.
int SimpleEncodeCuda(int element_bytes, const float* values, uint64_t count, uint8_t* payload, void* stream);
// Decode: out[i] = decoded (accumulate false) or out[i] += decoded (accumulate true).
int SimpleDecodeCuda(int element_bytes, const uint8_t* payload, uint64_t count, float* out, bool accumulate,
                     void* stream);
// Fused DAR in place: payload = encode(decoded + local).
int SimpleDarCuda(int element_bytes, uint8_t* payload, const float* local, uint64_t count, void* stream);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CUDA_ALLREDUCE_KERNELS_H_
