#include "server/step_budget_planner.h"

#include <algorithm>
#include <cmath>

#include "kernels/codec_info.h"

namespace dynamiq::server {
namespace {

bool SameCodec(const kernels::CodecConfig& a, const kernels::CodecConfig& b) {
  return a.id == b.id && a.bits == b.bits && a.allocator == b.allocator && a.levels == b.levels;
}

}  // namespace

double StepBudgetPlanner::BitsFor(const std::string& key, const kernels::CodecConfig& codec) const {
  if (codec.id != kernels::CodecId::kDynamiq || !SameCodec(codec, planned_for_)) return 0;
  auto it = shares_.find(key);
  return it == shares_.end() ? 0 : it->second;
}

void StepBudgetPlanner::Record(const std::string& key, size_t num_elements, std::vector<double> energies,
                               const kernels::CodecConfig& codec, const kernels::WidthErrors& errors) {
  if (codec.id != kernels::CodecId::kDynamiq || num_elements == 0) return;
  if (!SameCodec(codec, planned_for_)) Reset();  // shares and a partial step of another budget
  planned_for_ = codec;
  if (step_keys_.count(key) != 0) {
    // The step is complete: split its budget. Shares are rounded down to what the step header
    // carries (1/1000 bit), so the step never spends more than its b̄.
    std::vector<std::vector<double>> energy;
    std::vector<size_t> sizes;
    for (Bucket& b : step_) {
      energy.push_back(std::move(b.energies));
      sizes.push_back(b.num_elements);
    }
    const kernels::CodecInfo& info = kernels::GetCodecInfo(kernels::CodecId::kDynamiq);
    const std::vector<double> split =
        kernels::StepBudgets(energy, sizes, codec.bits, info.min_bits, info.max_bits, codec.allocator, errors);
    shares_.clear();
    for (size_t k = 0; k < step_.size(); ++k) {
      shares_[step_[k].key] = std::max(info.min_bits, std::floor(split[k] * 1000) / 1000);
    }
    step_.clear();
    step_keys_.clear();
    step_super_groups_ = 0;
  }
  step_super_groups_ += energies.size();
  step_.push_back(Bucket{key, num_elements, std::move(energies)});
  step_keys_.insert(key);
  while (step_.size() > kMaxStepBuckets || (step_super_groups_ > kMaxStepSuperGroups && step_.size() > 1)) {
    DropOldest();
  }
}

void StepBudgetPlanner::DropOldest() {
  step_super_groups_ -= step_.front().energies.size();
  step_keys_.erase(step_.front().key);
  step_.pop_front();
}

void StepBudgetPlanner::Reset() {
  step_.clear();
  step_keys_.clear();
  step_super_groups_ = 0;
  shares_.clear();
}

}  // namespace dynamiq::server
