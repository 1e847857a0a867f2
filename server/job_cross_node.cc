// Job's cross-node step (server/job.h): the collective's id on the wire, the transport, codec,
// error feedback and side lane it runs with, and what a failure does to the group.
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/allreduce.h"
#include "engine/step_header.h"
#include "server/job.h"

namespace dynamiq::server {
namespace {

// Stable 64-bit id of a job name for the engine's step headers (FNV-1a).
uint64_t JobHash(absl::string_view id) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : id) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

// What the step headers' job field carries: the job and its incarnation, the tensor's name, element
// count and dtype, so nodes whose workers submitted different tensors (or sizes, or dtypes: the
// cross-node sum is fp32 either way) fail the header check at once, and messages of an earlier
// incarnation of the job are refused.
uint64_t CollectiveId(absl::string_view job, uint64_t incarnation, absl::string_view tensor, uint64_t num_elements,
                      kernels::DType dtype, bool weighted) {
  const std::string nul(1, '\0');
  // Incarnation 1 is the plain job id.
  const std::string id = incarnation <= 1 ? std::string(job) : absl::StrCat(job, nul, "inc", incarnation);
  // A weighted collective is another collective: nodes that disagree fail the header check at
  // once instead of waiting for a side lane that never comes.
  return JobHash(absl::StrCat(id, nul, tensor, nul, num_elements, nul, kernels::DTypeName(dtype),
                              weighted ? absl::StrCat(nul, "weighted") : ""));
}

}  // namespace

absl::StatusOr<DataPath::CrossNodeResult> Job::CrossNode(uint64_t sequence, const JobConfig& config, uint64_t epoch,
                                                         absl::string_view tensor_name, kernels::DType dtype, size_t n,
                                                         double bits, bool weighted, absl::Span<double> side_sums) {
  DQ_ASSIGN_OR_RETURN(engine::Transport * transport, group_.Connected(sequence));
  DQ_ASSIGN_OR_RETURN(kernels::Codec * codec, codecs_.Get(EffectiveCodec(config, n)));
  engine::AllReduceOptions o;
  o.topology = config.topology;
  o.job_id = CollectiveId(options_.id, options_.incarnation, tensor_name, n, dtype, weighted);
  o.side_sums = side_sums;
  o.config_epoch = epoch;
  o.sequence = sequence;
  o.bits = bits;
  o.timeout = std::max(absl::Milliseconds(1), deadline_ - absl::Now());
  o.authenticator = options_.authenticator.get();
  // A job under an error budget may sample more often than the daemon's default rate.
  const double rate = config.error_budget.has_value() && config.error_budget->sample_rate > 0
                          ? config.error_budget->sample_rate
                          : options_.error_sample_rate;
  // arc_topk's error feedback: the tensor's state, all of it dropped at a compression change.
  if (epoch != error_feedback_epoch_) {
    error_feedback_.Clear();
    error_feedback_epoch_ = epoch;
  }
  ErrorFeedbackState* error_feedback = nullptr;
  if (codec->id() == kernels::CodecId::kArcTopK && options_.arc_topk_error_feedback) {
    const uint64_t evicted = error_feedback_.evicted();
    absl::StatusOr<ErrorFeedbackState*> state = error_feedback_.Get(tensor_name, n, epoch, sequence);
    if (error_feedback_.evicted() > evicted && evicted == 0) {
      // Once per job: a step's tensors do not fit, so some restart with the dense step each time.
      common::Log(
          "job %s: arc_topk error feedback reached its limit of %zu bytes (--error_feedback_mib); least recently "
          "used tensors' state is dropped to make room",
          options_.id, options_.error_feedback_bytes);
    }
    if (!state.ok()) {
      const absl::Status failed(state.status().code(), absl::StrCat("collective ", sequence, " of job ", options_.id,
                                                                    ": ", state.status().message()));
      // Like a failed local reduce: the other nodes learn why instead of waiting for this one.
      group_.Announce(group_.Decide({{sequence, failed}}));
      return failed;
    }
    error_feedback = *state;
  }
  path_->SetErrorFeedback(error_feedback, error_feedback_.momentum());
  absl::StatusOr<DataPath::CrossNodeResult> result = path_->CrossNode(*codec, *transport, o, n, rate);
  if (!result.ok()) {
    group_.Drop(/*abort=*/false);
    std::string hint;
    if (engine::IsDifferentCollective(result.status())) {
      hint = absl::StrFormat(
          " (the nodes' workers submitted different tensors; this node all-reduces '%s', %d x %s: every worker "
          "of a job must submit the same tensors in the same order)",
          tensor_name, n, kernels::DTypeName(dtype));
    }
    return absl::Status(result.status().code(), absl::StrCat("collective ", sequence, " of job ", options_.id, ": ",
                                                             result.status().message(), hint));
  }
  if (result->regroup) group_.Drop(/*abort=*/false);  // the measurement on the side broke the group
  return result;
}

}  // namespace dynamiq::server
