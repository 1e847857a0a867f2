// CodecFuzzCase: how the codec fuzzers (codec_fuzzer.cc) and the seed generator (seed_corpus.cc)
// turn the first kCaseParamBytes bytes of a fuzz input into one decoder call: which configuration
// of the codec, the bucket (size, world, round), the plan derived from statistics (possibly hostile:
// NaN, Inf, negative, huge), the chunk, and this rank's local values. The rest of the input is the
// received chunk: verbatim (raw mode) or as edits applied to a valid encoding (mutate mode), so the
// fuzzer reaches the payload decoders without first having to discover a valid header.
//
// Parameter bytes:
//   0      configuration variant (codec-specific: bits, allocator, levels, correlated rounding)
//   1      flags: kFlag* below; bits 6..7 with bit 7 of byte 12: the SIMD target (modulo the CPU's)
//   2..3   bucket elements, little-endian, modulo kMaxFuzzElements + 1
//   4      world size (low nibble + 1) and rank (high nibble modulo world size)
//   5      chunk start, in super-groups of 256 (modulo the bucket's super-groups + 1)
//   6..7   chunk elements, modulo what is left of the bucket + 1
//   8..11  collective round
//   12     rounding siblings (low 2 bits + 1), sibling index (bits 2..3), group (bits 4..6)
//   13     seed of the local values
//   14     magnitude of the local values: 2^(byte - 140)
//   15     statistics: < 128 consistent; otherwise one statistic is replaced by a hostile value
#ifndef DQ_TESTS_FUZZ_CODEC_FUZZ_CASE_H_
#define DQ_TESTS_FUZZ_CODEC_FUZZ_CASE_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec.h"

namespace dynamiq::fuzz {

inline constexpr size_t kCaseParamBytes = 16;

// fuzz_step_header authenticates with this job's key; dq_fuzz_seeds seals its seeds with it too.
inline constexpr char kFuzzClusterSecret[] = "fuzz cluster secret";
inline constexpr char kFuzzJob[] = "job";
inline constexpr uint32_t kFuzzReceiver = 1;
// fuzz_udp_datagram receives as kFuzzReceiver of a group of 4 on this connection, with the job's
// key or the checksum; dq_fuzz_seeds seals its seeds for it.
inline constexpr uint64_t kFuzzUdpConnection = 0x5eed5eed5eed5eed;
inline constexpr uint32_t kFuzzUdpGroupSize = 4;
inline constexpr size_t kFuzzUdpMaxPayload = 1412;
// Up to 17 super-groups, the last one partial: enough for every layout, small enough for speed.
inline constexpr size_t kMaxFuzzElements = 16 * 256 + 100;

inline constexpr uint8_t kFlagDestBf16 = 1u << 0;    // decode into bf16 instead of fp32
inline constexpr uint8_t kFlagLocalBf16 = 1u << 1;   // local values are bf16
inline constexpr uint8_t kFlagMeans = 1u << 2;       // use the plan's mean centring (DynamiQ)
inline constexpr uint8_t kFlagMutate = 1u << 3;      // the rest of the input edits a valid encoding
inline constexpr uint8_t kFlagNonFinite = 1u << 4;   // one local value is Inf or NaN
inline constexpr uint8_t kFlagAggregated = 1u << 5;  // mutate mode: start from a DAR output, not a leaf

// A heap array of exactly `size` elements, so AddressSanitizer reports any access past its end
// (std::vector's spare capacity would hide it).
template <typename T>
struct ExactBuffer {
  explicit ExactBuffer(size_t n) : size(n), data(new T[n == 0 ? 1 : n]()) {}
  ExactBuffer(const T* src, size_t n) : ExactBuffer(n) { std::copy(src, src + n, data.get()); }
  absl::Span<T> span() { return absl::Span<T>(data.get(), size); }
  absl::Span<const T> cspan() const { return absl::Span<const T>(data.get(), size); }
  size_t size;
  std::unique_ptr<T[]> data;
};

struct CodecFuzzCase {
  const kernels::Codec* codec = nullptr;  // owned by a per-process cache
  uint8_t flags = 0;
  int simd_target = 0;  // index into the CPU's Highway targets (the harness takes it modulo)
  kernels::BucketPlan plan;
  kernels::ChunkRef chunk;      // the chunk as the receiver (and a leaf sender) names it
  kernels::ChunkRef dar_chunk;  // with this rank's rounding siblings, as DAR is called
  // This rank's values of the chunk only (Source::first = chunk.begin), fp32 or bf16.
  std::unique_ptr<ExactBuffer<uint8_t>> local;
  kernels::DType local_dtype = kernels::DType::kFloat32;
  kernels::DType dest_dtype = kernels::DType::kFloat32;
  // Per-super-group mean centring of the whole bucket (empty unless kFlagMeans and DynamiQ).
  std::unique_ptr<ExactBuffer<float>> subtract, add;

  kernels::Source Source() const;
  kernels::Dest Dest(void* data) const;
};

// Number of configuration variants byte 0 selects from (modulo).
int NumVariants(kernels::CodecId id);

// Builds the case. An error means the parameters describe no valid plan (e.g. MakePlan rejected
// hostile statistics): the input is then uninteresting beyond MakePlan not crashing.
absl::StatusOr<CodecFuzzCase> MakeCodecFuzzCase(kernels::CodecId id, absl::Span<const uint8_t> params);

// A valid encoding of the case's chunk: a leaf's Compress, or (aggregated) the DAR of a leaf's
// encoding by one more rank. Fails where the codec cannot encode the local values (THC and Inf).
absl::StatusOr<std::vector<uint8_t>> ValidEncoding(const CodecFuzzCase& c, bool aggregated);

// Applies edits (4 bytes each: position u16, op, value) to `bytes`: op 0 xors a byte, 1 sets one,
// 2 truncates at the position, 3 inserts the value there. At most kMaxEdits.
inline constexpr size_t kMaxEdits = 64;
void ApplyEdits(absl::Span<const uint8_t> edits, std::vector<uint8_t>* bytes);

}  // namespace dynamiq::fuzz

#endif  // DQ_TESTS_FUZZ_CODEC_FUZZ_CASE_H_
