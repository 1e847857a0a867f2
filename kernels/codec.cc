#include "kernels/codec.h"

namespace dynamiq::kernels {

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
