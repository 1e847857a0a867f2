#include "server/job_config.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/codec_registry.h"

namespace dynamiq::server {

absl::StatusOr<JobConfig> MakeJobConfig(absl::string_view codec, double bits, absl::string_view topology,
                                        uint64_t min_compress_elements, absl::string_view allocator) {
  JobConfig c;
  DQ_ASSIGN_OR_RETURN(c.codec.id, kernels::ParseCodecId(codec));
  if (bits == 0) {  // the codec's default; codecs without a bit setting keep 0
    bits = c.codec.id == kernels::CodecId::kDynamiq                                             ? 5.0
           : (c.codec.id == kernels::CodecId::kUniform || c.codec.id == kernels::CodecId::kThc) ? 4.0
                                                                                                : 0.0;
  }
  c.codec.bits = bits;
  if (allocator.empty() || allocator == "measured") {
    c.codec.allocator = kernels::BitAllocator::kMeasured;
  } else if (allocator == "paper") {
    c.codec.allocator = kernels::BitAllocator::kPaper;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown allocator '", allocator, "' (measured or paper)"));
  }
  DQ_RETURN_IF_ERROR(kernels::ValidateCodecConfig(c.codec));
  DQ_ASSIGN_OR_RETURN(c.topology, engine::ParseTopology(topology.empty() ? "ring" : topology));
  c.min_compress_elements = min_compress_elements;
  return c;
}

absl::Status SetErrorBudget(const ErrorBudgetPolicy& policy, JobConfig& config) {
  DQ_RETURN_IF_ERROR(ValidateErrorBudgetPolicy(policy));
  if (config.codec.id != kernels::CodecId::kDynamiq) {
    return absl::InvalidArgumentError(absl::StrCat("an error budget (target_vnmse) needs codec dynamiq, not ",
                                                   kernels::CodecName(config.codec.id),
                                                   ": only DynamiQ has a fractional bit budget to adjust"));
  }
  config.codec.bits = CompressionController::InitialBits(policy, config.codec.bits);
  config.error_budget = policy;
  return absl::OkStatus();
}

std::string DescribeJobConfig(const JobConfig& c) {
  std::string s = absl::StrFormat("%s bits=%g %s min_compress=%d", kernels::CodecName(c.codec.id), c.codec.bits,
                                  engine::TopologyName(c.topology), c.min_compress_elements);
  if (c.error_budget.has_value()) {
    absl::StrAppendFormat(&s, " target_vnmse=%g bits=[%g,%g]", c.error_budget->target_vnmse, c.error_budget->min_bits,
                          c.error_budget->max_bits);
    if (c.error_budget->sample_rate > 0) absl::StrAppendFormat(&s, " sample_rate=%g", c.error_budget->sample_rate);
  }
  return s;
}

absl::StatusOr<DeviceKind> ParseDeviceKind(absl::string_view name) {
  if (name == "cpu") return DeviceKind::kCpu;
  if (name == "cuda") return DeviceKind::kCuda;
  return absl::InvalidArgumentError(absl::StrCat("unknown device '", name, "' (cpu or cuda)"));
}

absl::string_view DeviceKindName(DeviceKind device) { return device == DeviceKind::kCuda ? "cuda" : "cpu"; }

absl::Status CheckConfigForDevice(const JobConfig& config, DeviceKind device) {
  if (device == DeviceKind::kCpu) return absl::OkStatus();
  switch (config.codec.id) {
    case kernels::CodecId::kNone:
    case kernels::CodecId::kBf16:
    case kernels::CodecId::kDynamiq:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "codec ", kernels::CodecName(config.codec.id),
          " is not available on a --device=cuda node: its device all-reduce supports none, bf16 and dynamiq"));
  }
  if (config.error_budget.has_value()) {
    return absl::InvalidArgumentError(
        "an error budget (target_vnmse) is not available on a --device=cuda node: the compression error is "
        "measured on CPU nodes only; set fixed bits");
  }
  return absl::OkStatus();
}

}  // namespace dynamiq::server
