#include "server/error_feedback.h"

#include <new>

#include "absl/strings/str_cat.h"

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

}  // namespace dynamiq::server
