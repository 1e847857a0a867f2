#include "server/cross_node_group.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/status_macros.h"

namespace dynamiq::server {
namespace {

// How long a node's reports of why it failed collectives may take in all (a worker leaving can fail
// many queued ones at once).
constexpr absl::Duration kReportTimeout = absl::Seconds(1);
// How long a node whose cross-node part was cut short waits for the cause. The failing node reports
// before it breaks the group, so after a reset the cause is there (or a report is a moment away:
// the failing node's reducer may close the old group first); a node that ran into its own deadline
// may have done so a moment before the other node's watchdog fired. A failure nobody explains (a
// daemon killed) reaches the workers this much later.
constexpr absl::Duration kCauseWaitAfterReset = absl::Milliseconds(300);
constexpr absl::Duration kCauseWaitAfterDeadline = absl::Seconds(1);
// Connects a collective tries: the first, and again in each newer view claimed during the wait (a
// member went silent) that applies to it.
constexpr int kConnectAttempts = 4;

// `message` without its leading "collective <seq> of job <id>" (and the ": " or " " after it).
absl::string_view WithoutCollectivePrefix(absl::string_view message, absl::string_view prefix) {
  if (absl::ConsumePrefix(&message, prefix) && !absl::ConsumePrefix(&message, ": ")) {
    absl::ConsumePrefix(&message, " ");
  }
  return message;
}

}  // namespace

CrossNodeGroup::CrossNodeGroup(std::string job_id, GroupView view, std::shared_ptr<JobCoordinator> coordinator)
    : job_id_(std::move(job_id)),
      single_node_(view.size() <= 1 && view.epoch() == 0),
      coordinator_(std::move(coordinator)),
      view_(std::move(view)) {}

GroupView CrossNodeGroup::view() const {
  absl::MutexLock lock(&view_mu_);
  return view_;
}

void CrossNodeGroup::AdoptDueView(uint64_t sequence) {
  // The newest view whose first collective `sequence` has reached; the ones before it never run here
  // (a view that applied earlier was passed over by the newer one).
  auto due = pending_.end();
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->first_sequence() <= sequence) due = it;
  }
  if (due == pending_.end()) return;
  {
    absl::MutexLock lock(&view_mu_);
    view_ = *due;
  }
  pending_.erase(pending_.begin(), due + 1);
  // The boundary: every member drops the old connection here and connects in the new view.
  transport_.reset();
  reconnect_ = false;
}

void CrossNodeGroup::AddPending(std::vector<GroupView> views) {
  for (GroupView& v : views) {
    const uint64_t known = pending_.empty() ? view_.epoch() : pending_.back().epoch();
    if (v.epoch() > known) pending_.push_back(std::move(v));
  }
}

bool CrossNodeGroup::HasPeers() const {
  absl::MutexLock lock(&view_mu_);
  return !single_node_ && coordinator_ != nullptr && view_.is_member();
}

absl::Status CrossNodeGroup::Refresh(uint64_t sequence) {
  if (single_node_ || coordinator_ == nullptr) return absl::OkStatus();
  GroupView known;
  {
    absl::MutexLock lock(&mu_);
    known = pending_.empty() ? view_ : pending_.back();
  }
  DQ_ASSIGN_OR_RETURN(std::vector<GroupView> newer, coordinator_->ViewsAfter(known));
  absl::MutexLock lock(&mu_);
  AddPending(std::move(newer));
  AdoptDueView(sequence);
  return absl::OkStatus();
}

absl::Status CrossNodeGroup::Settle(uint64_t sequence) {
  absl::MutexLock lock(&mu_);
  return SettleLocked(sequence);
}

absl::Status CrossNodeGroup::SettleLocked(uint64_t sequence) {
  // Refresh adopts a view at its boundary only where the job polls; a view learned earlier still
  // applies at its boundary when the job skips the poll there.
  AdoptDueView(sequence);
  if (reconnect_) {
    transport_.reset();
    reconnect_ = false;
  }
  if (single_node_ || coordinator_ == nullptr || transport_) return absl::OkStatus();
  absl::Status last;
  for (int attempt = 0; attempt < kConnectAttempts; ++attempt) {
    // A new connection starts from the newest view: one claimed while this node was not looking
    // (a member went silent, server/membership.h) applies from the collective it broke.
    LearnNewerViews();
    AdoptDueView(sequence);
    if (!view_.is_member() || view_.size() <= 1) return absl::OkStatus();  // no transport: the job says why
    // A failed connect is a failed collective: the next one connects again, under its own keys.
    absl::StatusOr<std::unique_ptr<engine::Transport>> connected = coordinator_->Connect(view_, sequence);
    if (connected.ok()) {
      transport_ = *std::move(connected);
      ++transport_serial_;
      silent_reason_.clear();
      return absl::OkStatus();
    }
    last = common::Annotate(connected.status(), absl::StrCat("collective ", sequence, " of job ", job_id_));
    // The wait ended because a view without a silent member was claimed: connect in it, if it
    // applies to this collective already.
    LearnNewerViews();
    bool due = false;
    for (const GroupView& v : pending_) due = due || v.first_sequence() <= sequence;
    if (!due) break;
  }
  return last;
}

void CrossNodeGroup::LearnNewerViews() {
  absl::StatusOr<std::vector<GroupView>> newer = coordinator_->ViewsAfter(pending_.empty() ? view_ : pending_.back());
  if (newer.ok()) AddPending(*std::move(newer));
}

absl::StatusOr<engine::Transport*> CrossNodeGroup::Connected(uint64_t sequence) {
  absl::MutexLock lock(&mu_);
  DQ_RETURN_IF_ERROR(SettleLocked(sequence));
  if (!view_.is_member()) {
    return absl::FailedPreconditionError(absl::StrCat("collective ", sequence, " of job ", job_id_, ": node ",
                                                      view_.node_rank(), " is not a member of the job's ",
                                                      view_.ToString()));
  }
  if (!transport_) return absl::FailedPreconditionError("a job of one node has no transport");
  return transport_.get();
}

bool CrossNodeGroup::AbortIfIncludes(const std::vector<uint32_t>& silent, const std::string& why) {
  // Not while a connect holds the lock: that wait ends by itself (ClusterJobCoordinator).
  if (!mu_.TryLock()) return false;
  bool aborted = false;
  bool includes = false;
  for (uint32_t node : silent) includes = includes || view_.IndexOf(node) >= 0;
  if (includes && transport_) {
    transport_->Abort();
    reconnect_ = true;
    silent_reason_ = why;
    aborted = true;
  }
  mu_.Unlock();
  return aborted;
}

void CrossNodeGroup::Drop(bool abort) {
  absl::MutexLock lock(&mu_);
  if (abort && transport_) transport_->Abort();
  transport_.reset();
}

CrossNodeGroup::Break CrossNodeGroup::Decide(Failures failures) {
  Break broken;
  absl::MutexLock lock(&mu_);
  if (!HasPeers() || failures.empty()) return broken;
  reconnect_ = true;
  broken.failures = std::move(failures);
  broken.transport = transport_serial_;
  return broken;
}

void CrossNodeGroup::Announce(const Break& broken) {
  if (broken.failures.empty()) return;
  Report(broken.failures);
  absl::MutexLock lock(&mu_);
  if (transport_ && transport_serial_ == broken.transport) transport_->Abort();
}

void CrossNodeGroup::Report(const Failures& failures) {
  if (!HasPeers()) return;  // a node outside the view must not stop the members' connects
  const absl::Time deadline = absl::Now() + kReportTimeout;  // for all of them together
  for (const auto& [sequence, cause] : failures) {
    // Give up once the coordinator is out of reach.
    if (!coordinator_->ReportFailure(sequence, cause, deadline).ok()) break;
  }
}

void CrossNodeGroup::Abort() {
  absl::MutexLock lock(&mu_);
  if (transport_) transport_->Abort();
}

void CrossNodeGroup::Close() {
  absl::MutexLock lock(&mu_);
  transport_.reset();
  reconnect_ = false;
}

absl::Status CrossNodeGroup::WithRemoteCause(uint64_t sequence, absl::Status error) {
  // A peer that breaks the group resets the connections (UNAVAILABLE), or this node's step runs into
  // its deadline first (a peer's watchdog fires at about the same time). ABORTED is this node's own
  // abort (Stop, its own break): nothing to look up.
  bool silent_failure = false;
  if (absl::IsAborted(error)) {
    absl::MutexLock lock(&mu_);
    // Aborted because a member went silent (AbortIfIncludes): say that, not "aborted".
    if (!silent_reason_.empty()) {
      error = absl::UnavailableError(absl::StrCat("collective ", sequence, " of job ", job_id_, ": ", silent_reason_,
                                                  " (here: ", error.message(), ")"));
      // Published, so that a member already connecting for this collective in the next view stops
      // waiting for this node, which goes on to the next one.
      silent_failure = true;
    }
  }
  if (silent_failure) {
    Report({{sequence, error}});
    return error;
  }
  if (single_node_ || coordinator_ == nullptr || absl::IsAborted(error)) return error;
  if (!absl::IsUnavailable(error) && !absl::IsDeadlineExceeded(error)) {
    Report({{sequence, error}});
    return error;
  }
  const absl::Duration wait = absl::IsUnavailable(error) ? kCauseWaitAfterReset : kCauseWaitAfterDeadline;
  std::optional<FailureCause> cause = coordinator_->LookupFailure(sequence, absl::Now() + wait);
  if (!cause.has_value() || cause->status.ok()) return error;
  const std::string prefix = absl::StrCat("collective ", sequence, " of job ", job_id_);
  return common::Restate(cause->status,
                         absl::StrCat(prefix, " failed on node ", cause->node, ": ",
                                      WithoutCollectivePrefix(cause->status.message(), prefix),
                                      " (here: ", WithoutCollectivePrefix(error.message(), prefix), ")"));
}

}  // namespace dynamiq::server
