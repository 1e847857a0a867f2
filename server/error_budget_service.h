// ErrorBudgetService: runs the error-budget controllers (server/compression_controller.h) of the
// jobs whose configuration carries an error budget, and publishes their decisions.
//
// dynamiqd runs one on node 0 (every node measures the same error samples, so one controller per job
// suffices). It is a JobObserver: each sampled collective's error, with the configuration and epoch
// it ran under, goes to the job's controller. A job's controller is created when a sample first
// shows a budget, replaced when the policy changes, and dropped when a sample shows none (a
// fixed-bits change). Decisions are published on the service's own thread, since samples arrive
// with the job's lock held: the job's configuration with the new b̄, through `publish` (dynamiqd:
// Daemon::SetCompression with expected_epoch = the epoch the decision was based on, so a decision
// never overrides a newer operator change; it is then reported back to the controller as published
// or rejected). Every decision, publication and refusal is kept as an Event (the flight recorder's
// controller events) and passed to `on_event` (metrics, the daemon's log).
//
// Thread-safe. Lock order: `mu_` is a leaf while samples arrive; `publish` and `on_event` are
// called without it.
#ifndef DQ_SERVER_ERROR_BUDGET_SERVICE_H_
#define DQ_SERVER_ERROR_BUDGET_SERVICE_H_

#include <stdint.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/compression_controller.h"
#include "server/job_config.h"
#include "server/job_observer.h"

namespace dynamiq::server {

class ErrorBudgetService final : public JobObserver {
 public:
  // Publishes `config` for `job` unless the job's epoch has moved past `expected_epoch`; returns the
  // epoch it got.
  using PublishFn =
      std::function<absl::StatusOr<uint64_t>(const std::string& job, const JobConfig& config, uint64_t expected_epoch)>;

  // What the controller did, as operators see it.
  struct Event {
    absl::Time time;
    std::string job;
    // raise, lower, clamp (decisions, once published), rejected (publishing failed), policy (a
    // controller started for a new or changed budget).
    std::string kind;
    double target_vnmse = 0;
    double from_bits = 0;
    double bits = 0;
    double measured_vnmse = 0;   // the sample that triggered it
    double predicted_vnmse = 0;  // the model's prediction at `bits` (decisions)
    uint64_t based_on_epoch = 0;
    uint64_t epoch = 0;  // the epoch it was published as (0 unless published)
    std::string reason;
  };
  using EventFn = std::function<void(const Event&)>;

  struct JobState {
    ErrorBudgetPolicy policy;
    CompressionController::Stats stats;
  };

  ErrorBudgetService(PublishFn publish, EventFn on_event = nullptr, ControllerTuning tuning = {},
                     size_t events_kept = 256);
  ~ErrorBudgetService() override;  // Stop()
  ErrorBudgetService(const ErrorBudgetService&) = delete;
  ErrorBudgetService& operator=(const ErrorBudgetService&) = delete;

  // Drops pending decisions and joins the publisher; later samples are ignored. Idempotent.
  void Stop();

  // JobObserver: samples feed the controllers; the rest is not needed.
  void OnErrorSample(const std::string& job, const SampledError& sample) override;
  void OnCollective(const std::string&, const CollectiveOutcome&) override {}
  void OnRejected(absl::StatusCode) override {}

  // The job's controller state; nullopt when the job has no budget (or no sample yet).
  std::optional<JobState> State(const std::string& job) const;
  // The job's most recent `limit` events (0: all kept), oldest first.
  std::vector<Event> Events(const std::string& job, size_t limit) const;
  // Forgets a job that ended (its controller, pending decisions and events).
  void ForgetJob(const std::string& job);
  // Blocks until no decision is waiting to be published or `timeout` passes; true when idle.
  bool WaitIdle(absl::Duration timeout) const;

 private:
  struct Pending {
    std::string job;
    JobConfig config;  // to publish
    BitsDecision decision;
    std::shared_ptr<CompressionController> controller;
    double measured_vnmse = 0;
  };

  void PublishLoop();
  void Emit(Event event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PublishFn publish_;
  const EventFn on_event_;
  const ControllerTuning tuning_;
  const size_t events_kept_;

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<CompressionController>> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool publishing_ ABSL_GUARDED_BY(mu_) = false;  // the publisher is working on one outside the lock
  std::deque<Event> events_ ABSL_GUARDED_BY(mu_);
  std::deque<Event> to_report_ ABSL_GUARDED_BY(mu_);  // for on_event_, called outside the lock
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread publisher_;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_ERROR_BUDGET_SERVICE_H_
