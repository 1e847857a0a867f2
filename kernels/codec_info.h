// CodecInfo: what each codec offers, in one table: its name, whether it has a bit setting (its
// range and default), and whether the GPU all-reduce implements it. The daemon's configuration
// checks, dynamiqctl's tables, the codec registry and the NCCL all-reduce all consult this table,
// so adding a codec, or a codec to the GPU path, is one row. Abseil only: dynamiqctl links it
// without the kernels.
#ifndef DQ_KERNELS_CODEC_INFO_H_
#define DQ_KERNELS_CODEC_INFO_H_

#include <stdint.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dynamiq::kernels {

// Codec ids are part of the wire format (ChunkHeader::codec): never renumber.
enum class CodecId : uint8_t {
  kNone = 0,        // fp32, lossless
  kBf16 = 1,        // bf16, round to nearest even at every hop
  kDynamiq = 2,     // DynamiQ: variable-width non-uniform groups, hierarchical scales
  kMxfp8 = 3,       // OCP MX, E4M3 elements, E8M0 scale per 32
  kMxfp6 = 4,       // OCP MX, E3M2
  kMxfp4 = 5,       // OCP MX, E2M1
  kThc = 6,         // THC: randomized Hadamard + lookup tables, integer-summable
  kUniform = 7,     // uniform stochastic b-bit quantizer, bf16 scale per 32
  kInt8 = 8,        // INTELLECT-1-style: 8-bit stochastic, f32 scale per chunk, clip at +-6 sigma
  kGlobalQsgd = 9,  // Global-QSGD: stochastic levels against a global max |x|, integer-summable
  kArcTopK = 10,    // ARC-Top-K: rows agreed from a sketch of the sum, their fp32 values index-free
  kFlash = 11,      // Flash Communication: b-bit asymmetric round-to-nearest, bf16 min and scale per 128
};
inline constexpr int kNumCodecs = 12;

struct CodecInfo {
  CodecId id;
  absl::string_view name;
  // The bit setting. Without one (has_bits false) a configuration carries bits 0.
  bool has_bits = false;
  double default_bits = 0;
  double min_bits = 0;
  double max_bits = 0;
  bool integer_bits = false;
  absl::string_view bits_meaning;  // "average incl. metadata", "bits per code", arc_topk: a density
  // The device all-reduce (engine/nccl_allreduce.h) implements it: GPU nodes may run it.
  bool on_cuda = false;
};

// Every codec, by id.
absl::Span<const CodecInfo> AllCodecs();
// The row of `id` (every CodecId has one).
const CodecInfo& GetCodecInfo(CodecId id);

absl::string_view CodecName(CodecId id);
// Accepts the names CodecName returns ("none", "bf16", "dynamiq", "mxfp8", ...).
absl::StatusOr<CodecId> ParseCodecId(absl::string_view name);
// OK, or INVALID_ARGUMENT naming the codec's range, for `bits` (0 is not "default" here).
absl::Status CheckCodecBits(CodecId id, double bits);
// A bit setting as an operator gives it (dynamiqd --bits, dynamiqctl set-compression --bits, a
// job's configuration): 0 is the codec's default; a codec without a bit setting takes only 0
// (INVALID_ARGUMENT saying so: its wire width is fixed); others CheckCodecBits.
absl::Status CheckBitsSetting(CodecId id, double bits);
// "dynamiq 5, thc 4, uniform 4, global_qsgd 8, arc_topk 0.1": every codec's default bits, for help
// texts (dynamiqd --bits, dynamiqctl --bits), from the table.
std::string DefaultBitsSummary();
// "none, bf16 and dynamiq": the codecs GPU nodes run, for messages.
std::string CudaCodecNames();

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CODEC_INFO_H_
