#include "server/error_feedback.h"

#include <algorithm>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/codec_registry.h"

namespace dynamiq::server {

size_t ErrorFeedback::PerElement() const { return (momentum_ < 1.0 ? 3 : 2) * sizeof(float); }

size_t ErrorFeedback::Cost(const Map::iterator& it) const {
  return PerElement() * it->second.state.local.size() + kStateOverheadBytes + it->first.size();
}

void ErrorFeedback::Erase(Map::iterator it) {
  bytes_ -= Cost(it);
  lru_.erase(it->second.in_lru);
  states_.erase(it);
}

absl::StatusOr<ErrorFeedbackState*> ErrorFeedback::Get(absl::string_view tensor, size_t n, uint64_t epoch,
                                                       uint64_t sequence) {
  // Retire what has not been used for max_idle_ collectives (a name that never comes back).
  while (!lru_.empty()) {
    auto oldest = states_.find(lru_.front());
    const uint64_t last = oldest->second.last_used;
    if (sequence <= last || sequence - last <= max_idle_) break;
    Erase(oldest);
    ++retired_idle_;
  }
  auto it = states_.find(tensor);
  if (it != states_.end() && (it->second.state.local.size() != n || it->second.state.epoch != epoch)) {
    // A compression change (new epoch) or a different tensor under the same name: start over.
    Erase(it);
    it = states_.end();
  }
  if (it != states_.end()) {
    lru_.splice(lru_.end(), lru_, it->second.in_lru);  // most recently used
    it->second.last_used = sequence;
    return &it->second.state;
  }
  const size_t need = PerElement() * n + kStateOverheadBytes + tensor.size();
  if (need > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("arc_topk error feedback of tensor '", tensor, "' needs ", need,
                                                     " bytes, more than the job's limit of ", max_bytes_,
                                                     " (--error_feedback_mib)"));
  }
  // Make room: the least recently used states go (their tensors start over with the dense step).
  while (need > max_bytes_ - bytes_ && !lru_.empty()) {
    Erase(states_.find(lru_.front()));
    ++evicted_;
  }
  Entry entry;
  entry.state.epoch = epoch;
  entry.last_used = sequence;
  try {
    entry.state.local.assign(n, 0.0f);
    entry.state.global.assign(n, 0.0f);
    if (momentum_ < 1.0) entry.state.momentum.assign(n, 0.0f);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no memory for the arc_topk error feedback of tensor '", tensor, "' (", need, " bytes)"));
  }
  it = states_.emplace(std::string(tensor), std::move(entry)).first;
  it->second.in_lru = lru_.insert(lru_.end(), it->first);
  bytes_ += need;
  return &it->second.state;
}

void ErrorFeedback::Clear() {
  states_.clear();
  lru_.clear();
  bytes_ = 0;
}

namespace {

absl::StatusOr<engine::AllReduceResult> Step(const kernels::Codec& codec, engine::Transport& transport,
                                             const engine::AllReduceOptions& options, float* x, size_t n,
                                             ErrorFeedbackState& s, double eta) {
  const bool momentum = eta < 1.0;
  if (momentum && s.momentum.size() != n) {
    return absl::InternalError(absl::StrCat("arc_topk error feedback: momentum ", eta, " without its state"));
  }
  const kernels::Dest out{x, kernels::DType::kFloat32, 0, nullptr};
  if (!s.initialized) {
    // g_i = x, G = the exact sum (the authors' first step: a dense all-reduce).
    std::copy(x, x + n, s.local.begin());
    if (momentum) std::copy(x, x + n, s.momentum.begin());
    DQ_ASSIGN_OR_RETURN(auto none, kernels::CreateCodec(kernels::CodecConfig{kernels::CodecId::kNone}));
    DQ_ASSIGN_OR_RETURN(
        engine::AllReduceResult r,
        engine::AllReduce(*none, transport, options, {x, kernels::DType::kFloat32, 0, nullptr}, out, n));
    std::copy(x, x + n, s.global.begin());
    s.initialized = true;
    return r;
  }
  std::vector<float> u(n);
  if (momentum) {
    const float keep = static_cast<float>(1.0 - eta), take = static_cast<float>(eta);
    for (size_t i = 0; i < n; ++i) {
      s.momentum[i] = keep * s.momentum[i] + take * x[i];
      u[i] = s.momentum[i] - s.local[i];
    }
  } else {
    for (size_t i = 0; i < n; ++i) u[i] = x[i] - s.local[i];
  }
  engine::AllReduceOptions o = options;
  o.keep_plan_widths = true;
  DQ_ASSIGN_OR_RETURN(engine::AllReduceResult r,
                      engine::AllReduce(codec, transport, o, {u.data(), kernels::DType::kFloat32, 0, nullptr}, out, n));
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

}  // namespace

absl::StatusOr<engine::AllReduceResult> ErrorFeedbackAllReduce(const kernels::Codec& codec,
                                                               engine::Transport& transport,
                                                               const engine::AllReduceOptions& options, float* x,
                                                               size_t n, ErrorFeedbackState& state, double eta) {
  absl::StatusOr<engine::AllReduceResult> r = Step(codec, transport, options, x, n, state, eta);
  if (!r.ok()) state.initialized = false;
  return r;
}

}  // namespace dynamiq::server
