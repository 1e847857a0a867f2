// Job's check that the local workers' submissions of a collective agree (server/job.h): none was
// refused, and all are of the same tensor, size, dtype, exactness and weightedness.
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "server/job.h"

namespace dynamiq::server {

absl::Status Job::CheckLocalAgreement(uint64_t sequence, const std::vector<Entry*>& entries) const {
  for (const Entry* e : entries) {
    if (!e->request.refused.ok()) {
      return common::Restate(
          e->request.refused,
          absl::StrFormat("collective %d of job %s: local rank %d's all-reduce of it was refused (%s), "
                          "so it fails for every local worker",
                          sequence, options_.id, e->local_rank, e->request.refused.message()));
    }
  }
  // Every local worker must submit the same collective.
  for (const Entry* e : entries) {
    const Request& a = entries[0]->request;
    const Request& b = e->request;
    if (a.exact != b.exact) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "collective %d of job %s: local rank %d submitted it %s, local rank %d %s; every worker submits an "
          "exact (uncompressed) all-reduce alike",
          sequence, options_.id, entries[0]->local_rank, a.exact ? "exact" : "not exact", e->local_rank,
          b.exact ? "exact" : "not exact"));
    }
    if (a.weight.has_value() != b.weight.has_value()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "collective %d of job %s: local rank %d submitted it %s a weight, local rank %d %s; every worker submits "
          "with a weight or every one without",
          sequence, options_.id, entries[0]->local_rank, a.weight.has_value() ? "with" : "without", e->local_rank,
          b.weight.has_value() ? "with one" : "without"));
    }
    if (a.tensor_name != b.tensor_name || a.num_elements != b.num_elements || a.dtype != b.dtype) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "collective %d of job %s: local rank %d submitted '%s' (%d x %s), local rank %d submitted '%s' (%d x %s)",
          sequence, options_.id, entries[0]->local_rank, a.tensor_name, a.num_elements, kernels::DTypeName(a.dtype),
          e->local_rank, b.tensor_name, b.num_elements, kernels::DTypeName(b.dtype)));
    }
  }
  return absl::OkStatus();
}

}  // namespace dynamiq::server
