#include "kernels/codec.h"

#include <array>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dynamiq::kernels {
namespace {

constexpr std::array<absl::string_view, kNumCodecs> kNames = {"none",  "bf16",  "dynamiq", "mxfp8",
                                                              "mxfp6", "mxfp4", "thc",     "uniform"};

}  // namespace

absl::string_view CodecName(CodecId id) {
  size_t i = static_cast<size_t>(id);
  return i < kNames.size() ? kNames[i] : "unknown";
}

absl::StatusOr<CodecId> ParseCodecId(absl::string_view name) {
  for (size_t i = 0; i < kNames.size(); ++i) {
    if (kNames[i] == name) return static_cast<CodecId>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown codec '", name, "' (expected one of: ", absl::StrJoin(kNames, ", "), ")"));
}

size_t Codec::StatsLength(size_t) const { return 0; }

void Codec::ComputeStats(const Source&, size_t, float*) const {}

absl::StatusOr<BucketPlan> Codec::MakePlan(const RoundInfo& round, size_t num_elements, absl::Span<const float>,
                                           absl::Span<const float>) const {
  BucketPlan plan;
  plan.round = round;
  plan.num_elements = num_elements;
  return plan;
}

}  // namespace dynamiq::kernels
