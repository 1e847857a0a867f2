// Host launchers of the CUDA kernels. Host-only and free of CUDA and absl headers, so code
// compiled by g++ (engines, tests) can drive the GPU without including cuda_runtime.h.
//
// Conventions:
//   - Every pointer argument of a launcher is a DEVICE pointer unless stated otherwise.
//   - `stream` is a cudaStream_t passed as void*; nullptr means the legacy default stream.
//   - Launchers are asynchronous: they return once the work is queued on `stream`. The int they
//     return is a cudaError_t value (kCudaSuccess == cudaSuccess == 0); errors of the kernel
//     itself surface at the next synchronisation (CudaStreamSynchronize).
//   - Nothing here allocates or frees memory behind the caller's back.
//
// Thread-safety: all functions may be called from any host thread (the CUDA runtime is
// thread-safe); work queued on one stream runs in order.
#ifndef DQ_KERNELS_CUDA_LAUNCH_H_
#define DQ_KERNELS_CUDA_LAUNCH_H_

#include <stddef.h>
#include <stdint.h>

#include "kernels/dynamiq_math.h"

namespace dynamiq::kernels {

inline constexpr int kCudaSuccess = 0;

// ---- Runtime helpers (thin wrappers of the CUDA runtime API).

// True if the CUDA runtime sees at least one device. Never crashes: without a driver or device
// (cudaGetDeviceCount fails) it returns false.
bool CudaDeviceAvailable();
// cudaGetErrorString for a value returned by the functions below.
const char* CudaErrorString(int error);
int CudaMalloc(void** ptr, size_t bytes);
int CudaFree(void* ptr);  // nullptr is a no-op
// cudaMemcpyAsync host -> device / device -> host on `stream`. With pageable host memory the
// copy may still be in flight when this returns: synchronise before reusing or reading `dst`.
int CudaCopyToDevice(void* dst, const void* host_src, size_t bytes, void* stream);
int CudaCopyToHost(void* host_dst, const void* src, size_t bytes, void* stream);
int CudaStreamSynchronize(void* stream);

// ---- DynamiQ super-group kernels (layout and math: kernels/dynamiq_math.h).
//
// One call works on a run of consecutive super-groups (SGs) of one chunk: SG j of the run holds
// elements [256 j, min(256 (j + 1), count)) of the run, so only the last SG may be partial. The
// SGs' bytes lie back to back (the chunk payload after its width map); SG j starts at offsets[j].
// kernels/cuda/dynamiq_cuda_host.h fills this from a BucketPlan and ChunkRef exactly as
// DynamiqCodec lays out and keys a chunk, so GPU and CPU produce identical bytes.
struct DynamiqDeviceArgs {
  const LevelTable* tables = nullptr;  // device: kMaxWidth + 1 tables indexed by width, copied from
                                       // the host codec (entries 0 and 1 are never read)
  const uint8_t* widths = nullptr;     // device: width of each SG of the run, 0 or 2..8
  const uint64_t* offsets = nullptr;   // device: byte offset of each SG from the first SG's start
  uint64_t count = 0;                  // elements in the run (num_sg = ceil(count / 256))
  uint64_t first_sg = 0;               // bucket-level index of the run's first SG
  uint32_t key = 0;                    // this rank's stream key: StreamKey(seed, round, rank)
  uint32_t shared_key = 0;             // StreamKey(seed, round, kSharedStream ^ Mix32(rounding_group))
  uint32_t rounding_index = 0;         // ChunkRef::rounding_index
  uint32_t rounding_size = 1;          // ChunkRef::rounding_size
  bool correlated = false;             // config.correlated_rounding && rounding_size > 1
};

// Number of SGs a run of `count` elements spans.
DQ_HOST_DEVICE uint64_t DynamiqNumSuperGroups(uint64_t count) {
  return (count + kSuperGroupSize - 1) / kSuperGroupSize;
}

// Compress: encodes values[0, count) (fp32, already mean-centred) into the run's SGs. SGs of
// width 0 are skipped (they take no bytes).
int DynamiqEncodeCuda(const DynamiqDeviceArgs& args, const float* values, uint8_t* payload_sgs, void* stream);

// Decompress: out[i] = decoded element i (accumulate false; width-0 SGs write zeros) or
// out[i] += decoded element i (accumulate true; width-0 SGs leave out unchanged), i < count.
// The SGs must have passed DynamiqValidateCuda (invalid input decodes to garbage but is never
// read or written out of bounds).
int DynamiqDecodeCuda(const DynamiqDeviceArgs& args, const uint8_t* payload_sgs, float* out, bool accumulate,
                      void* stream);

// DecompressAccumulateRecompress, fused: each SG is decoded, `local` added, and the sum re-encoded
// at the same width into out_sgs, with no intermediate buffer. in_sgs must be validated;
// in_sgs == out_sgs (in place) is allowed, other overlaps are not.
int DynamiqDarCuda(const DynamiqDeviceArgs& args, const uint8_t* in_sgs, const float* local, uint8_t* out_sgs,
                   void* stream);

// Runs ValidateSuperGroup on every SG of the run (and rejects widths other than 0 and 2..8).
// *bad_sg (a device int) is set to -1 on `stream` first, then to the smallest run-relative index j
// of a malformed SG, if any; the bucket-level index is first_sg + j.
int DynamiqValidateCuda(const DynamiqDeviceArgs& args, const uint8_t* payload_sgs, int* bad_sg, void* stream);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CUDA_LAUNCH_H_
