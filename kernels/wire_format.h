// ChunkHeader: the fixed 32-byte, little-endian header in front of every compressed chunk.
//
//   offset size field
//        0    4 magic          "DQC1" (0x31435144)
//        4    1 version        kWireVersion
//        5    1 codec          CodecId
//        6    1 element_bits   codec-specific code width (0 = per super-group, see codec docs)
//        7    1 flags          kFlag* bits
//        8    4 num_elements   elements in the chunk (<= kMaxChunkElements)
//       12    4 chunk_id       which chunk of the bucket
//       16    4 round          low 32 bits of the collective round
//       20    2 num_summands   contributions summed into this chunk (1 at a leaf)
//       22    2 reserved       must be 0
//       24    4 payload_bytes  bytes that follow the header
//       28    4 param          codec-specific float (THC: global scale), else 0
//
// docs/wire_format.md describes every codec's payload. Parsing validates everything a peer
// could get wrong or forge; decoders then validate their payload (codes, scales) themselves.
#ifndef DQ_KERNELS_WIRE_FORMAT_H_
#define DQ_KERNELS_WIRE_FORMAT_H_

#include <stddef.h>
#include <stdint.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec.h"

namespace dynamiq::kernels {

inline constexpr uint32_t kChunkMagic = 0x31435144u;  // "DQC1" read little-endian
inline constexpr uint8_t kWireVersion = 1;
inline constexpr size_t kChunkHeaderBytes = 32;
inline constexpr uint32_t kMaxChunkElements = 1u << 30;

// Flag bits. (DynamiQ's uniform-levels choice per width travels in element_bits, not here.)
inline constexpr uint8_t kFlagCorrelated = 1u << 0;  // stratified rounding across ranks
inline constexpr uint8_t kFlagAggregated = 1u << 2;  // THC: payload holds integer sums

struct ChunkHeader {
  CodecId codec = CodecId::kNone;
  uint8_t element_bits = 0;
  uint8_t flags = 0;
  uint32_t num_elements = 0;
  uint32_t chunk_id = 0;
  uint32_t round = 0;
  uint16_t num_summands = 1;
  uint32_t payload_bytes = 0;
  float param = 0.0f;
};

// Writes the header into out[0, kChunkHeaderBytes). `out` must be at least that large.
void WriteChunkHeader(const ChunkHeader& header, absl::Span<uint8_t> out);

// Parses and validates a header: magic, version, known codec, reserved bits, element count
// limit, and that `bytes` holds the whole payload. Returns INVALID_ARGUMENT / DATA_LOSS errors
// that say what was wrong.
absl::StatusOr<ChunkHeader> ParseChunkHeader(absl::Span<const uint8_t> bytes);

// The same for a header whose payload lies elsewhere (a split message, Codec::BodyIsFloat32):
// `head` is the header alone and the payload has `payload_bytes`.
absl::StatusOr<ChunkHeader> ParseDetachedChunkHeader(absl::Span<const uint8_t> head, size_t payload_bytes);

// Checks that a parsed header is the chunk the caller expects (codec, chunk id, element count,
// round) and that its payload has exactly `expected_payload_bytes`.
absl::Status ValidateChunkHeader(const ChunkHeader& header, CodecId codec, const BucketPlan& plan,
                                 const ChunkRef& chunk, size_t expected_payload_bytes);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_WIRE_FORMAT_H_
