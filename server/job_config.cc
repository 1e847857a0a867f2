#include "server/job_config.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "engine/lossy_all_reduce.h"
#include "kernels/codec_info.h"
#include "kernels/codec_registry.h"
#include "server/request_names.h"

namespace dynamiq::server {

absl::StatusOr<JobConfig> MakeJobConfig(absl::string_view codec, double bits, absl::string_view topology,
                                        uint64_t min_compress_elements, absl::string_view allocator) {
  JobConfig c;
  DQ_ASSIGN_OR_RETURN(c.codec.id, kernels::ParseCodecId(codec));
  // Bits on a codec without a bit setting would be shown (int8/3.7) but never used: refused.
  DQ_RETURN_IF_ERROR(kernels::CheckBitsSetting(c.codec.id, bits));
  if (bits == 0) bits = kernels::GetCodecInfo(c.codec.id).default_bits;  // 0 without a bit setting
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

void ToProto(const JobConfig& c, dynamiq::v1::CompressionConfig* out) {
  out->set_codec(std::string(kernels::CodecName(c.codec.id)));
  out->set_bits(c.codec.bits);
  out->set_topology(std::string(engine::TopologyName(c.topology)));
  out->set_min_compress_elements(c.min_compress_elements);
  out->set_allocator(c.codec.allocator == kernels::BitAllocator::kMeasured ? "measured" : "paper");
  if (c.error_budget.has_value()) {
    dynamiq::v1::ErrorBudget* b = out->mutable_error_budget();
    b->set_target_vnmse(c.error_budget->target_vnmse);
    b->set_min_bits(c.error_budget->min_bits);
    b->set_max_bits(c.error_budget->max_bits);
    b->set_sample_rate(c.error_budget->sample_rate);
  }
  out->set_lossy_phase_ms(absl::ToDoubleMilliseconds(c.lossy_phase));
}

absl::StatusOr<JobConfig> FromProto(const dynamiq::v1::CompressionConfig& c) {
  DQ_RETURN_IF_ERROR(CheckRequestName("codec", c.codec(), kMaxConfigNameBytes, /*allow_empty=*/true));
  DQ_RETURN_IF_ERROR(CheckRequestName("topology", c.topology(), kMaxConfigNameBytes, /*allow_empty=*/true));
  DQ_RETURN_IF_ERROR(CheckRequestName("allocator", c.allocator(), kMaxConfigNameBytes, /*allow_empty=*/true));
  DQ_ASSIGN_OR_RETURN(JobConfig config,
                      MakeJobConfig(c.codec(), c.bits(), c.topology(), c.min_compress_elements(), c.allocator()));
  if (c.has_error_budget() && c.error_budget().target_vnmse() != 0) {  // a zero target is no budget
    const dynamiq::v1::ErrorBudget& b = c.error_budget();
    ErrorBudgetPolicy policy;
    policy.target_vnmse = b.target_vnmse();
    policy.min_bits = b.min_bits() == 0 ? kMinDynamiqBits : b.min_bits();
    policy.max_bits = b.max_bits() == 0 ? kMaxDynamiqBits : b.max_bits();
    policy.sample_rate = b.sample_rate();
    DQ_RETURN_IF_ERROR(SetErrorBudget(policy, config));
  }
  DQ_RETURN_IF_ERROR(SetLossyPhase(c.lossy_phase_ms(), config));
  return config;
}

absl::Status SetLossyPhase(double milliseconds, JobConfig& config) {
  if (!(milliseconds >= 0 && milliseconds <= kMaxLossyPhaseMs)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lossy_phase_ms must be 0 (reliable) or up to ", kMaxLossyPhaseMs, ", got ", milliseconds));
  }
  config.lossy_phase = absl::Milliseconds(milliseconds);
  if (milliseconds == 0) return absl::OkStatus();
  if (!engine::LossyValuesOf(config.codec.id).has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the loss-tolerant all-reduce (lossy_phase_ms > 0) carries codec none, bf16 or int8, not ",
        kernels::CodecName(config.codec.id), ": every datagram must decode on its own; set lossy_phase_ms 0 first"));
  }
  if (config.error_budget.has_value()) {
    return absl::InvalidArgumentError("the loss-tolerant all-reduce (lossy_phase_ms > 0) takes no error budget");
  }
  return absl::OkStatus();
}

absl::StatusOr<JobConfig> ApplyCompressionChange(const JobConfig& newest, const dynamiq::v1::CompressionConfig& change,
                                                 absl::string_view job_id) {
  const dynamiq::v1::ErrorBudget& asked = change.error_budget();
  const bool new_target = change.has_error_budget() && asked.has_target_vnmse();
  const bool budget_fields =
      change.has_error_budget() && (asked.has_min_bits() || asked.has_max_bits() || asked.has_sample_rate());
  if (new_target && asked.target_vnmse() == 0 && budget_fields) {
    return absl::InvalidArgumentError("target_vnmse 0 (fixed bits) takes no min_bits, max_bits or sample_rate");
  }
  dynamiq::v1::CompressionConfig current;
  ToProto(newest, &current);
  dynamiq::v1::CompressionConfig next = current;
  next.clear_error_budget();
  if (change.has_codec()) {
    next.set_codec(change.codec());
  } else if (new_target && asked.target_vnmse() != 0) {
    next.set_codec("dynamiq");  // the codec with a fractional b̄ for the controller to adjust
  }
  if (change.has_bits()) {
    next.set_bits(change.bits());
  } else if (next.codec() != current.codec()) {
    next.set_bits(0);  // bits mean something else per codec: the new codec's default
  }
  if (change.has_topology()) next.set_topology(change.topology());
  if (change.has_min_compress_elements()) next.set_min_compress_elements(change.min_compress_elements());
  if (change.has_allocator()) next.set_allocator(change.allocator());
  if (change.has_lossy_phase_ms()) next.set_lossy_phase_ms(change.lossy_phase_ms());
  // The budget: a new target (on the current budget's fields, if any); the current one with
  // changed fields; kept when neither codec nor bits were given (e.g. a topology change); otherwise
  // none (fixed bits).
  const bool has_budget = newest.error_budget.has_value();
  std::optional<dynamiq::v1::ErrorBudget> budget;
  if (new_target) {
    if (asked.target_vnmse() != 0) {
      budget = has_budget ? current.error_budget() : dynamiq::v1::ErrorBudget();
      budget->set_target_vnmse(asked.target_vnmse());
    }
  } else if (budget_fields) {
    if (!has_budget) {
      return absl::InvalidArgumentError(
          absl::StrCat("job ", job_id, " has no error budget: min_bits, max_bits and sample_rate need a target_vnmse"));
    }
    budget = current.error_budget();
  } else if (has_budget && !change.has_codec() && !change.has_bits()) {
    budget = current.error_budget();
  }
  if (budget.has_value()) {
    if (asked.has_min_bits()) budget->set_min_bits(asked.min_bits());
    if (asked.has_max_bits()) budget->set_max_bits(asked.max_bits());
    if (asked.has_sample_rate()) budget->set_sample_rate(asked.sample_rate());
    *next.mutable_error_budget() = *std::move(budget);
  }
  return FromProto(next);
}

std::string DescribeJobConfig(const JobConfig& c) {
  std::string s = absl::StrFormat("%s bits=%g %s min_compress=%d", kernels::CodecName(c.codec.id), c.codec.bits,
                                  engine::TopologyName(c.topology), c.min_compress_elements);
  if (c.error_budget.has_value()) {
    absl::StrAppendFormat(&s, " target_vnmse=%g bits=[%g,%g]", c.error_budget->target_vnmse, c.error_budget->min_bits,
                          c.error_budget->max_bits);
    if (c.error_budget->sample_rate > 0) absl::StrAppendFormat(&s, " sample_rate=%g", c.error_budget->sample_rate);
  }
  if (c.lossy_phase > absl::ZeroDuration()) {
    absl::StrAppendFormat(&s, " lossy_phase=%gms", absl::ToDoubleMilliseconds(c.lossy_phase));
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
  if (!kernels::GetCodecInfo(config.codec.id).on_cuda) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", kernels::CodecName(config.codec.id),
                                                   " is not available on a --device=cuda node: its device all-reduce "
                                                   "supports ",
                                                   kernels::CudaCodecNames()));
  }
  if (config.error_budget.has_value()) {
    return absl::InvalidArgumentError(
        "an error budget (target_vnmse) is not available on a --device=cuda node: the compression error is "
        "measured on CPU nodes only; set fixed bits");
  }
  return absl::OkStatus();
}

absl::Status CheckErrorBudgetSampled(const JobConfig& config, uint32_t num_nodes, double error_sample_rate) {
  if (!config.error_budget.has_value()) return absl::OkStatus();
  if (num_nodes <= 1) {
    // The same refusal as dynamiqd's --target_vnmse on one node: no error is ever measured there.
    return absl::FailedPreconditionError(
        "an error budget (target_vnmse) needs the compression error measured between nodes, and a one-node "
        "cluster sums locally without compressing: set fixed bits, or run the job on two or more nodes");
  }
  if (config.error_budget->sample_rate == 0 && error_sample_rate == 0) {
    return absl::FailedPreconditionError(
        "an error budget needs error samples, but --error_sample_rate is 0: give the budget its own sample rate");
  }
  return absl::OkStatus();
}

}  // namespace dynamiq::server
