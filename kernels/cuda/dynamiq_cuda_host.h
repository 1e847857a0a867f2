// Host-side preparation of the DynamiQ CUDA kernels (kernels/cuda/launch.h): everything
// DynamiqCodec computes on the CPU while walking a chunk (per-super-group widths and byte offsets,
// the width map, the chunk header, the random-stream keys), computed up front so it can be copied
// to the GPU. Compiled by g++; no CUDA headers.
//
// A chunk's wire bytes are [ 32-byte header | width map | super-groups ]. The host writes the
// first two (WriteDynamiqChunkPrefix), the kernels the super-groups, at
// payload_sgs = chunk + kChunkHeaderBytes + width_map.size().
//
// Thread-safe: plain functions of their arguments.
#ifndef DQ_KERNELS_CUDA_DYNAMIQ_CUDA_HOST_H_
#define DQ_KERNELS_CUDA_DYNAMIQ_CUDA_HOST_H_

#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/cuda/launch.h"

namespace dynamiq::kernels {

// One chunk of a DynamiQ bucket, laid out as DynamiqCodec lays it out.
struct DynamiqCudaChunk {
  // Scalars filled in; tables, widths and offsets are left null for the caller to point at
  // device copies of the codec's tables (CopyDynamiqLevelTables), `widths` and `offsets`.
  DynamiqDeviceArgs args;
  std::vector<uint8_t> widths;     // per super-group of the chunk: 0 or 2..8
  std::vector<uint64_t> offsets;   // byte offset of each super-group from the first one
  std::vector<uint8_t> width_map;  // the payload's width map (one nibble per super-group)
  size_t sg_bytes = 0;             // bytes of all super-groups together

  size_t payload_bytes() const { return width_map.size() + sg_bytes; }
  size_t total_bytes() const;  // kChunkHeaderBytes + payload_bytes()
};

// Checks `chunk` against `plan` as DynamiqCodec does (INVALID_ARGUMENT otherwise, also for widths
// outside 0 and 2..8) and computes its layout and the keys of rank plan.round.rank under the
// codec's seed and rounding setting.
absl::StatusOr<DynamiqCudaChunk> PrepareDynamiqCudaChunk(const DynamiqCodec& codec, const BucketPlan& plan,
                                                         const ChunkRef& chunk);

// Copies the codec's level tables into tables[0, kMaxWidth + 1), indexed by width; entries 0 and 1
// (no codes) are zeroed. Upload these bytes as DynamiqDeviceArgs::tables.
void CopyDynamiqLevelTables(const DynamiqCodec& codec, LevelTable* tables);

// Writes the chunk header and width map, out[0, kChunkHeaderBytes + width_map.size()), exactly as
// DynamiqCodec::Compress (summands 1) or DecompressAccumulateRecompress (received summands + 1,
// saturating) would. `out` must hold that many bytes.
absl::Status WriteDynamiqChunkPrefix(const DynamiqCodec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                                     const DynamiqCudaChunk& layout, uint16_t summands, absl::Span<uint8_t> out);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CUDA_DYNAMIQ_CUDA_HOST_H_
