#include "client/ring_submitter.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/connection.h"
#include "common/status_macros.h"

namespace dynamiq::client::internal {
namespace {

// How long the reaper sleeps at most before it checks deadlines and the daemon's health again.
constexpr absl::Duration kReapInterval = absl::Milliseconds(50);
// How long a synchronous all-reduce looks for its answer before it sleeps (common/spin.h): small
// ones answer sooner than a sleeping thread wakes.
constexpr absl::Duration kSpin = absl::Microseconds(100);

AllReduceResult ToResult(const ipc::ring::RingCompletion& c) {
  AllReduceResult r;
  r.sequence = c.sequence;
  r.config_epoch = c.config_epoch;
  r.codec = c.codec;
  r.bits = c.bits;
  r.wire_bytes = c.wire_bytes;
  r.measured_vnmse = c.measured_vnmse;
  r.contributors = c.contributors;
  r.nodes = c.nodes;
  r.weight_sum = c.weight_sum;
  return r;
}

}  // namespace

RingSubmitter::RingSubmitter(std::unique_ptr<ipc::SubmissionRingClient> ring, std::string socket_path,
                             absl::Duration timeout)
    : ring_(std::move(ring)), socket_path_(std::move(socket_path)), timeout_(timeout) {}

RingSubmitter::~RingSubmitter() {
  std::thread reaper;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    reaper = std::move(reaper_);
  }
  if (reaper.joinable()) reaper.join();
  std::vector<Pending> left;
  {
    absl::MutexLock lock(&mu_);
    left.swap(pending_);
  }
  for (Pending& p : left) {
    if (p.done) p.done(absl::CancelledError("the dynamiq::Client was destroyed before the all-reduce completed"), {});
  }
}

absl::StatusOr<AllReduceResult> RingSubmitter::Run(uint32_t slot, ipc::ring::RingRequest request) {
  const absl::Time deadline = absl::Now() + timeout_;
  request.async = false;
  ring_->Submit(slot, request);
  const absl::Status waited = ring_->WaitDone(slot, deadline, kSpin);
  if (waited.ok()) return Collect(slot, deadline);
  if (absl::IsDeadlineExceeded(waited)) {
    Add(Pending{slot, absl::InfiniteFuture(), Done()});  // the slot is freed when the answer comes
    return DeadlinePassed();
  }
  return Unusable(waited);
}

void RingSubmitter::Start(uint32_t slot, ipc::ring::RingRequest request, Done done) {
  request.async = true;
  // Known to the reaper before the daemon can answer, so that no wake-up finds it missing.
  Add(Pending{slot, absl::Now() + timeout_, std::move(done)});
  ring_->Submit(slot, request);
}

absl::StatusOr<AllReduceResult> RingSubmitter::Collect(uint32_t slot, absl::Time deadline) {
  ipc::ring::RingCompletion c = ring_->Take(slot);
  if (!c.status.ok()) return FromDaemonStatus(c.status, "AllReduce", socket_path_, timeout_, deadline);
  return ToResult(c);
}

absl::Status RingSubmitter::DeadlinePassed() const {
  return absl::DeadlineExceededError(absl::StrCat("AllReduce to dynamiqd at ", socket_path_, " (deadline ",
                                                  absl::FormatDuration(timeout_),
                                                  ", DQ_TIMEOUT_SECONDS): no answer through the submission ring"));
}

absl::Status RingSubmitter::Unusable(const absl::Status& health) const {
  return common::Annotate(health, absl::StrCat("AllReduce to dynamiqd at ", socket_path_));
}

void RingSubmitter::Add(Pending pending) {
  absl::MutexLock lock(&mu_);
  pending_.push_back(std::move(pending));
  if (!reaper_.joinable() && !stop_) reaper_ = std::thread([this] { Reap(); });
}

void RingSubmitter::Reap() {
  while (true) {
    const uint32_t seen = ring_->AsyncDone();
    std::vector<Pending> answered;
    std::vector<Pending> expired;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](RingSubmitter* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->stop_ || !s->pending_.empty(); },
          this));
      if (stop_) return;
      const absl::Time now = absl::Now();
      std::vector<Pending> waiting;
      for (Pending& p : pending_) {
        if (ring_->IsDone(p.slot)) {
          answered.push_back(std::move(p));
        } else if (p.done && now >= p.deadline) {
          expired.push_back(Pending{p.slot, p.deadline, std::move(p.done)});
          waiting.push_back(Pending{p.slot, absl::InfiniteFuture(), Done()});  // abandoned: free when done
        } else {
          waiting.push_back(std::move(p));
        }
      }
      pending_.swap(waiting);
    }
    for (Pending& p : answered) {
      absl::StatusOr<AllReduceResult> r = Collect(p.slot, p.deadline);
      if (!p.done) continue;
      if (r.ok()) {
        p.done(absl::OkStatus(), *std::move(r));
      } else {
        p.done(r.status(), {});
      }
    }
    for (Pending& p : expired) p.done(DeadlinePassed(), {});
    if (const absl::Status health = ring_->Health(); !health.ok()) {
      // No answer will come: every waiter hears why now (their slots stay taken; the ring is dead).
      std::vector<Pending> dead;
      {
        absl::MutexLock lock(&mu_);
        dead.swap(pending_);
      }
      for (Pending& p : dead) {
        if (p.done) p.done(Unusable(health), {});
      }
      continue;
    }
    if (answered.empty()) ring_->WaitAsync(seen, kReapInterval);
  }
}

}  // namespace dynamiq::client::internal
