// StepBudgetPlanner: one DynamiQ bit budget per training step for a job (dynamiqd --step_budget).
//
// A training step all-reduces the same buckets in the same order every step (DDP), and a
// per-bucket budget gives each the same b̄ however much of the step's energy it holds. The planner
// records, for every completed DynamiQ collective, the per-super-group energies of its all-reduced
// result (identical on every node), keyed by bucket (tensor name and size). When a bucket comes
// round again, the step before it is complete: the planner splits the job's b̄ across that step's
// buckets (kernels::StepBudgets) and each bucket's following collectives run at its share, rounded
// down to 1/1000 bit (what the step header carries), until the next step completes. Measured on
// real gradients (docs/codec_real_gradients.md): the CNN's and the large-embedding LM's error drops
// 3.6-30x at the same bits; flat models gain ~10%.
//
// Until a full step is known, after Reset() (a failed collective, a configuration change) and for
// buckets the last step did not hold, BitsFor() returns 0: the job's b̄.
//
// Bounded: the shares are those of the last complete step only, and the step being recorded keeps
// at most kMaxStepBuckets buckets and kMaxStepSuperGroups energies; past either, its oldest
// buckets are dropped. Collectives whose names never repeat (no step ever completes) therefore
// cost a bounded window, not memory that grows with every collective; a step longer than the
// window is never planned (its buckets run at the job's b̄). Deterministic: nodes that
// see the same collectives with the same results plan the same shares; if they ever disagree, the
// step headers' bits differ and the collective fails naming both, and every node resets.
//
// Not thread-safe: one job's reducer thread owns it.
#ifndef DQ_SERVER_STEP_BUDGET_PLANNER_H_
#define DQ_SERVER_STEP_BUDGET_PLANNER_H_

#include <stddef.h>

#include <deque>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/codec.h"
#include "kernels/dynamiq_allocator.h"

namespace dynamiq::server {

class StepBudgetPlanner {
 public:
  // The most buckets, and energies (256-element super-groups), a step being recorded keeps.
  static constexpr size_t kMaxStepBuckets = 4096;
  static constexpr size_t kMaxStepSuperGroups = size_t{1} << 23;

  // The b̄ for the next collective of bucket `key` under `codec` (the collective's codec config):
  // its share of the last complete step, or 0 (use the codec's own bits).
  double BitsFor(const std::string& key, const kernels::CodecConfig& codec) const;

  // A collective of bucket `key` (`num_elements` > 0) completed under `codec`, a DynamiQ config
  // whose measured per-width errors are `errors`; `energies` holds the sum of squares of its
  // all-reduced result per 256-element super-group.
  void Record(const std::string& key, size_t num_elements, std::vector<double> energies,
              const kernels::CodecConfig& codec, const kernels::WidthErrors& errors);

  // Forgets the step being recorded and the shares.
  void Reset();

  // Buckets of the last complete step, for tests and metrics.
  size_t planned_buckets() const { return shares_.size(); }
  // Buckets and energies of the step being recorded, for tests.
  size_t recording_buckets() const { return step_.size(); }
  size_t recording_super_groups() const { return step_super_groups_; }

 private:
  void DropOldest();

  struct Bucket {
    std::string key;
    size_t num_elements = 0;
    std::vector<double> energies;
  };
  std::deque<Bucket> step_;               // the step being recorded, in order
  std::set<std::string> step_keys_;       // its keys
  size_t step_super_groups_ = 0;          // its energies
  std::map<std::string, double> shares_;  // from the last complete step
  kernels::CodecConfig planned_for_;      // the codec config the shares split
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_STEP_BUDGET_PLANNER_H_
