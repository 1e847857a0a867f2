#include "server/error_budget_service.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace dynamiq::server {

ErrorBudgetService::ErrorBudgetService(PublishFn publish, EventFn on_event, ControllerTuning tuning, size_t events_kept)
    : publish_(std::move(publish)), on_event_(std::move(on_event)), tuning_(tuning), events_kept_(events_kept) {
  publisher_ = std::thread([this] { PublishLoop(); });
}

ErrorBudgetService::~ErrorBudgetService() { Stop(); }

void ErrorBudgetService::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    queue_.clear();
  }
  if (publisher_.joinable()) publisher_.join();
}

void ErrorBudgetService::OnErrorSample(const std::string& job, const SampledError& sample) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  if (!sample.config.error_budget.has_value()) {
    jobs_.erase(job);  // a fixed-bits configuration: the operator took over
    return;
  }
  if (sample.codec.id != kernels::CodecId::kDynamiq) return;  // e.g. a tensor below min_compress
  const ErrorBudgetPolicy& policy = *sample.config.error_budget;
  auto it = jobs_.find(job);
  if (it == jobs_.end() || !(it->second->policy() == policy)) {
    absl::StatusOr<std::unique_ptr<CompressionController>> created = CompressionController::Create(policy, tuning_);
    if (!created.ok()) return;  // validated when it was set; a bad tuning is the daemon's bug
    it = jobs_.insert_or_assign(job, std::shared_ptr<CompressionController>(std::move(created).value())).first;
    Event e;
    e.kind = "policy";
    e.job = job;
    e.target_vnmse = policy.target_vnmse;
    e.from_bits = e.bits = sample.codec.bits;
    e.measured_vnmse = sample.vnmse;
    e.based_on_epoch = sample.config_epoch;
    e.reason = absl::StrCat("controller started: target vNMSE ", policy.target_vnmse, ", b̄ within [", policy.min_bits,
                            ", ", policy.max_bits, "]");
    Emit(std::move(e));
  }
  std::optional<BitsDecision> decision = it->second->Observe({sample.vnmse, sample.codec.bits, sample.config_epoch});
  if (!decision.has_value()) return;
  Pending p;
  p.job = job;
  p.config = sample.config;
  p.config.codec.bits = decision->bits;
  p.decision = std::move(*decision);
  p.controller = it->second;
  p.measured_vnmse = sample.vnmse;
  queue_.push_back(std::move(p));
}

void ErrorBudgetService::PublishLoop() {
  while (true) {
    std::optional<Pending> next;
    std::deque<Event> report;
    {
      absl::MutexLock lock(&mu_);
      publishing_ = false;
      auto ready = [this]()
                       ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty() || !to_report_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      report.swap(to_report_);
      if (!queue_.empty()) {
        next = std::move(queue_.front());
        queue_.pop_front();
      }
      publishing_ = true;  // until this round's events are reported and its decision published
    }
    if (on_event_) {
      for (const Event& e : report) on_event_(e);
    }
    if (!next.has_value()) continue;
    const BitsDecision& d = next->decision;
    absl::StatusOr<uint64_t> epoch = publish_(next->job, next->config, d.based_on_epoch);
    Event e;
    e.job = next->job;
    e.target_vnmse = next->config.error_budget->target_vnmse;
    e.from_bits = d.from_bits;
    e.bits = d.bits;
    e.measured_vnmse = next->measured_vnmse;
    e.predicted_vnmse = d.predicted_vnmse;
    e.based_on_epoch = d.based_on_epoch;
    if (epoch.ok()) {
      next->controller->Published(*epoch);
      e.kind = std::string(BitsDecisionKindName(d.kind));
      e.epoch = *epoch;
      e.reason = d.reason;
    } else {
      next->controller->Rejected();
      e.kind = "rejected";
      e.reason =
          absl::StrCat(BitsDecisionKindName(d.kind), " to ", d.bits, " not published: ", epoch.status().ToString());
    }
    absl::MutexLock lock(&mu_);
    Emit(std::move(e));
  }
}

void ErrorBudgetService::Emit(Event event) {
  event.time = absl::Now();
  events_.push_back(event);
  while (events_.size() > events_kept_) events_.pop_front();
  to_report_.push_back(std::move(event));
}

std::optional<ErrorBudgetService::JobState> ErrorBudgetService::State(const std::string& job) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return std::nullopt;
  return JobState{it->second->policy(), it->second->stats()};
}

std::vector<ErrorBudgetService::Event> ErrorBudgetService::Events(const std::string& job, size_t limit) const {
  absl::MutexLock lock(&mu_);
  std::vector<Event> out;
  for (const Event& e : events_) {
    if (e.job == job) out.push_back(e);
  }
  if (limit > 0 && out.size() > limit) out.erase(out.begin(), out.end() - static_cast<ptrdiff_t>(limit));
  return out;
}

void ErrorBudgetService::ForgetJob(const std::string& job) {
  absl::MutexLock lock(&mu_);
  jobs_.erase(job);
  std::erase_if(queue_, [&](const Pending& p) { return p.job == job; });
  std::erase_if(events_, [&](const Event& e) { return e.job == job; });
}

bool ErrorBudgetService::WaitIdle(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || (queue_.empty() && !publishing_ && to_report_.empty());
  };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

}  // namespace dynamiq::server
