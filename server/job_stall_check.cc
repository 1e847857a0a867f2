// Job's stall check (server/job.h): the reducer fails a collective that is still incomplete
// --timeout after its first request arrived, for every local worker of it, naming the local ranks
// that never submitted (or the earlier collective it waited behind).
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/job.h"

namespace dynamiq::server {

absl::Time Job::NextStall() const {
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [seq, slot] : slots_) {
    if (slot.running) continue;
    for (const auto& [rank, e] : slot.entries) next = std::min(next, e->stall_deadline);
  }
  return next;
}

void Job::ExpireStalled(Completions& out, CrossNodeGroup::Failures& failures) {
  const absl::Time now = absl::Now();
  for (auto it = slots_.begin(); it != slots_.end();) {
    const uint64_t sequence = it->first;
    Slot& slot = it->second;
    const Entry* first = nullptr;  // the slot's first request: its deadline is the slot's
    for (const auto& [rank, e] : slot.entries) {
      if (first == nullptr || e->stall_deadline < first->stall_deadline) first = e.get();
    }
    if (slot.running || first == nullptr || first->stall_deadline > now) {
      ++it;
      continue;
    }
    const std::string missing = MissingRanks(slot);  // the local workers that never submitted
    // Every local rank submitted: it waited behind an earlier collective that never ran.
    const std::string why = missing.empty()
                                ? absl::StrCat("every local rank submitted it, but it waited behind collective ",
                                               next_run_, ", which has not run")
                                : absl::StrCat("local ranks that did not submit: ", missing);
    // The collective can no longer complete here: fail it for every local worker and let the job
    // continue after it (other nodes see the failure as a timeout of the same collective).
    const absl::Status failed = absl::DeadlineExceededError(
        absl::StrCat("collective ", sequence, " of job ", options_.id, " timed out after ",
                     absl::FormatDuration(options_.timeout), " (dynamiqd --timeout); ", why));
    // The flight recorder keeps it like a collective that ran and failed.
    CollectiveRecord record;
    record.sequence = sequence;
    record.tensor_name = first->request.tensor_name;
    record.num_elements = first->request.num_elements;
    record.config = config_;
    record.config_epoch = config_epoch_;
    record.state = "failed";
    record.error = std::string(failed.message());
    record.start = now - options_.timeout;
    record.seconds = absl::ToDoubleSeconds(options_.timeout);
    Record(std::move(record));
    CountFailure(first->request.num_elements, {CollectiveResult::kTimeout, FaultKind::kTimeout});
    TakeSlot(slot, failed, out);
    failures.emplace_back(sequence, failed);
    if (sequence == next_run_) ++next_run_;
    it = slots_.erase(it);
  }
}

std::string Job::MissingRanks(const Slot& slot) const {
  std::vector<std::string> missing;
  for (uint32_t r = 0; r < options_.local_world_size; ++r) {
    if (slot.entries.count(r)) continue;
    std::string who = "not registered";
    for (const auto& [id, rank] : workers_) {
      if (rank != r) continue;
      auto pid = pids_.find(id);
      who = pid != pids_.end() ? absl::StrCat("worker ", id, ", pid ", pid->second) : absl::StrCat("worker ", id);
    }
    missing.push_back(absl::StrCat(r, " (", who, ")"));
  }
  return absl::StrJoin(missing, ", ");
}

}  // namespace dynamiq::server
