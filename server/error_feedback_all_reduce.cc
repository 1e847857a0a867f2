#include "server/error_feedback_all_reduce.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/codec_registry.h"

namespace dynamiq::server {

absl::StatusOr<CrossNodeAllReduce::Outcome> ErrorFeedbackAllReduce::Run(const kernels::Codec& codec,
                                                                        engine::Transport& transport,
                                                                        const engine::AllReduceOptions& options,
                                                                        float* data, size_t n) {
  if (codec.id() != kernels::CodecId::kArcTopK) return inner_.Run(codec, transport, options, data, n);
  absl::StatusOr<Outcome> r = Step(codec, transport, options, data, n);
  if (!r.ok()) state_.initialized = false;
  return r;
}

absl::StatusOr<CrossNodeAllReduce::Outcome> ErrorFeedbackAllReduce::Step(const kernels::Codec& codec,
                                                                         engine::Transport& transport,
                                                                         const engine::AllReduceOptions& options,
                                                                         float* x, size_t n) {
  ErrorFeedbackState& s = state_;
  const bool momentum = eta_ < 1.0;
  if (momentum && s.momentum.size() != n) {
    return absl::InternalError(absl::StrCat("arc_topk error feedback: momentum ", eta_, " without its state"));
  }
  if (!s.initialized) {
    // g_i = x, G = the exact sum (the authors' first step: a dense all-reduce).
    std::copy(x, x + n, s.local.begin());
    if (momentum) std::copy(x, x + n, s.momentum.begin());
    DQ_ASSIGN_OR_RETURN(auto none, kernels::CreateCodec(kernels::CodecConfig{kernels::CodecId::kNone}));
    DQ_ASSIGN_OR_RETURN(Outcome r, inner_.Run(*none, transport, options, x, n));
    std::copy(x, x + n, s.global.begin());
    s.initialized = true;
    return r;
  }
  // u goes into x too: the inner all-reduces in place, and x itself is not needed again.
  std::vector<float> u(n);
  if (momentum) {
    const float keep = static_cast<float>(1.0 - eta_), take = static_cast<float>(eta_);
    for (size_t i = 0; i < n; ++i) {
      s.momentum[i] = keep * s.momentum[i] + take * x[i];
      x[i] = u[i] = s.momentum[i] - s.local[i];
    }
  } else {
    for (size_t i = 0; i < n; ++i) x[i] = u[i] = x[i] - s.local[i];
  }
  engine::AllReduceOptions o = options;
  o.keep_plan_widths = true;
  DQ_ASSIGN_OR_RETURN(Outcome r, inner_.Run(codec, transport, o, x, n));
  const size_t rows = (n + 255) / 256;
  if (r.plan_widths.size() != rows) {
    return absl::InternalError(absl::StrCat("arc_topk error feedback: the all-reduce reported ", r.plan_widths.size(),
                                            " selected-row flags for ", rows, " rows"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (r.plan_widths[i / 256] != 0) s.local[i] += u[i];  // g_i += C(u_i)
    s.global[i] += x[i];                                  // G += sum_i C(u_i)
    x[i] = s.global[i];
  }
  return r;
}

}  // namespace dynamiq::server
