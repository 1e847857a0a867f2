#include "kernels/codec_info.h"

#include <array>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dynamiq::kernels {
namespace {

// By id (the array index is the CodecId).
constexpr std::array<CodecInfo, kNumCodecs> kCodecs = {{
    {CodecId::kNone, "none", false, 0, 0, 0, false, "", true},
    {CodecId::kBf16, "bf16", false, 0, 0, 0, false, "", true},
    {CodecId::kDynamiq, "dynamiq", true, 5, 3, 8, false, "average incl. metadata", true},
    {CodecId::kMxfp8, "mxfp8", false, 0, 0, 0, false, "", false},
    {CodecId::kMxfp6, "mxfp6", false, 0, 0, 0, false, "", false},
    {CodecId::kMxfp4, "mxfp4", false, 0, 0, 0, false, "", false},
    {CodecId::kThc, "thc", true, 4, 4, 4, true, "bits per code", false},
    {CodecId::kUniform, "uniform", true, 4, 2, 8, true, "bits per code", false},
    {CodecId::kInt8, "int8", false, 0, 0, 0, false, "", false},
    {CodecId::kGlobalQsgd, "global_qsgd", true, 8, 2, 8, true, "bits per code", false},
    {CodecId::kArcTopK, "arc_topk", true, 0.1, 0.001, 1, false, "density: the fraction of 256-element rows kept",
     false},
    {CodecId::kFlash, "flash", true, 4, 2, 8, true, "bits per code", false},
}};

constexpr bool IdsMatchIndices() {
  for (size_t i = 0; i < kCodecs.size(); ++i) {
    if (static_cast<size_t>(kCodecs[i].id) != i) return false;
  }
  return true;
}
static_assert(IdsMatchIndices(), "kCodecs must be indexed by CodecId");

}  // namespace

absl::Span<const CodecInfo> AllCodecs() { return kCodecs; }

const CodecInfo& GetCodecInfo(CodecId id) {
  const size_t i = static_cast<size_t>(id);
  return kCodecs[i < kCodecs.size() ? i : 0];
}

absl::string_view CodecName(CodecId id) {
  const size_t i = static_cast<size_t>(id);
  return i < kCodecs.size() ? kCodecs[i].name : "unknown";
}

absl::StatusOr<CodecId> ParseCodecId(absl::string_view name) {
  std::vector<absl::string_view> names;
  for (const CodecInfo& c : kCodecs) {
    if (c.name == name) return c.id;
    names.push_back(c.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown codec '", name, "' (expected one of: ", absl::StrJoin(names, ", "), ")"));
}

absl::Status CheckCodecBits(CodecId id, double bits) {
  const CodecInfo& c = GetCodecInfo(id);
  if (!c.has_bits) {
    // The value is carried unused, but a non-finite or absurd one is refused all the same, so that
    // it never reaches a status or a metric label.
    if (bits >= 0 && bits <= 32) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("bits must be a number between 0 and 32, got ", bits, " (codec ", c.name, " does not use it)"));
  }
  const bool in_range = bits >= c.min_bits && bits <= c.max_bits && (!c.integer_bits || bits == std::floor(bits));
  if (in_range) return absl::OkStatus();
  if (c.min_bits == c.max_bits) {
    return absl::InvalidArgumentError(absl::StrCat(c.name, " uses ", c.min_bits, "-bit codes, got bits ", bits));
  }
  return absl::InvalidArgumentError(absl::StrCat(c.name, " bits must be ", c.integer_bits ? "an integer " : "between ",
                                                 c.min_bits, c.integer_bits ? ".." : " and ", c.max_bits, " (",
                                                 c.bits_meaning, "), got ", bits));
}

absl::Status CheckBitsSetting(CodecId id, double bits) {
  if (bits == 0) return absl::OkStatus();
  const CodecInfo& c = GetCodecInfo(id);
  if (!c.has_bits) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", c.name,
                                                   " has no bit setting (its wire width is fixed), got bits ", bits,
                                                   ": leave bits unset (or 0)"));
  }
  return CheckCodecBits(id, bits);
}

std::string DefaultBitsSummary() {
  std::vector<std::string> parts;
  for (const CodecInfo& c : kCodecs) {
    if (c.has_bits) parts.push_back(absl::StrCat(c.name, " ", c.default_bits));
  }
  return absl::StrJoin(parts, ", ");
}

std::string CudaCodecNames() {
  std::vector<absl::string_view> names;
  for (const CodecInfo& c : kCodecs) {
    if (c.on_cuda) names.push_back(c.name);
  }
  if (names.size() <= 1) return absl::StrJoin(names, "");
  return absl::StrCat(absl::StrJoin(names.begin(), names.end() - 1, ", "), " and ", names.back());
}

}  // namespace dynamiq::kernels
