#include "server/metrics.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/build_info.h"

namespace dynamiq::server {
namespace {

using prometheus::Counter;
using prometheus::Gauge;
using prometheus::Histogram;

// 100 us .. 100 s, four buckets per decade.
const Histogram::BucketBoundaries& DurationBuckets() {
  static const auto* buckets = [] {
    auto* b = new Histogram::BucketBoundaries;
    for (int k = 0; k <= 24; ++k) b->push_back(1e-4 * std::pow(10.0, k / 4.0));
    return b;
  }();
  return *buckets;
}

// 1e-9 .. 1, factor sqrt(10).
const Histogram::BucketBoundaries& VnmseBuckets() {
  static const auto* buckets = [] {
    auto* b = new Histogram::BucketBoundaries;
    for (int k = 0; k <= 18; ++k) b->push_back(1e-9 * std::pow(10.0, k / 2.0));
    return b;
  }();
  return *buckets;
}

constexpr CollectiveResult kResults[] = {CollectiveResult::kOk, CollectiveResult::kError, CollectiveResult::kTimeout,
                                         CollectiveResult::kAborted};
constexpr FaultKind kFaults[] = {FaultKind::kTimeout, FaultKind::kAbort, FaultKind::kPeerFailure, FaultKind::kMismatch};
// Codes worker and operator requests are refused with; created at zero so alerts see them.
constexpr absl::StatusCode kRejectReasons[] = {
    absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,   absl::StatusCode::kFailedPrecondition,
    absl::StatusCode::kAlreadyExists,   absl::StatusCode::kOutOfRange, absl::StatusCode::kResourceExhausted,
    absl::StatusCode::kUnauthenticated, absl::StatusCode::kAborted,    absl::StatusCode::kUnavailable,
    absl::StatusCode::kPermissionDenied};

}  // namespace

class Metrics::Collector final : public prometheus::Collectable {
 public:
  explicit Collector(Metrics* metrics) : metrics_(metrics) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    metrics_->Refresh();
    return metrics_->registry_->Collect();
  }

 private:
  Metrics* const metrics_;
};

Metrics::Metrics(uint32_t node_rank, uint32_t num_nodes, std::string transport)
    : node_rank_(node_rank),
      num_nodes_(num_nodes),
      transport_label_(num_nodes <= 1 ? "local" : std::move(transport)),
      registry_(std::make_shared<prometheus::Registry>()),
      collectives_(prometheus::BuildCounter()
                       .Name("dynamiq_collectives_total")
                       .Help("Finished collectives by result (ok, error, timeout, aborted).")
                       .Register(*registry_)),
      duration_(prometheus::BuildHistogram()
                    .Name("dynamiq_collective_duration_seconds")
                    .Help("Time of a successful collective on this node, from the last local submission to the "
                          "result in every local worker's buffer (excluding the error probe).")
                    .Register(*registry_)),
      payload_bytes_(prometheus::BuildCounter()
                         .Name("dynamiq_payload_bytes_total")
                         .Help("Uncompressed fp32 bytes all-reduced by successful collectives (elements x 4, once "
                               "per collective).")
                         .Register(*registry_)),
      bus_bytes_(prometheus::BuildCounter()
                     .Name("dynamiq_bus_bytes_total")
                     .Help("Payload bytes x 2(n-1)/n over n nodes (nccl-tests bus bytes).")
                     .Register(*registry_)),
      wire_bytes_(prometheus::BuildCounter()
                      .Name("dynamiq_wire_bytes_total")
                      .Help("Bytes this node sent for the cross-node all-reduce of successful collectives, step "
                            "headers included.")
                      .Register(*registry_)),
      vnmse_(prometheus::BuildHistogram()
                 .Name("dynamiq_compression_error_vnmse")
                 .Help("Measured vNMSE ||x^ - x||^2 / ||x||^2 of sampled collectives against an exact fp32 sum "
                       "computed on the side.")
                 .Register(*registry_)),
      error_samples_(prometheus::BuildCounter()
                         .Name("dynamiq_compression_error_samples_total")
                         .Help("Collectives sampled for the compression error.")
                         .Register(*registry_)),
      peer_bytes_(prometheus::BuildCounter()
                      .Name("dynamiq_peer_bytes_total")
                      .Help("Bytes sent to and received from each peer node (all jobs, error probes included).")
                      .Register(*registry_)),
      faults_(prometheus::BuildCounter()
                  .Name("dynamiq_faults_total")
                  .Help("Failed collectives by cause (timeout, abort, peer_failure, mismatch).")
                  .Register(*registry_)),
      local_wait_(prometheus::BuildCounter()
                      .Name("dynamiq_local_wait_seconds_total")
                      .Help("Seconds each successful collective's first local worker waited for its last one to "
                            "submit, by the local rank that submitted last.")
                      .Register(*registry_)),
      local_last_(prometheus::BuildCounter()
                      .Name("dynamiq_local_last_submissions_total")
                      .Help("Successful collectives whose last local submission was this local rank's.")
                      .Register(*registry_)),
      node_wait_(prometheus::BuildCounter()
                     .Name("dynamiq_node_wait_seconds_total")
                     .Help("Seconds this node's part of each successful collective waited for the node whose part was "
                           "ready last, by that node (0 added when it was this node).")
                     .Register(*registry_)),
      node_last_(prometheus::BuildCounter()
                     .Name("dynamiq_node_last_ready_total")
                     .Help("Successful collectives whose cross-node part waited for this node last.")
                     .Register(*registry_)),
      lossy_datagrams_(prometheus::BuildCounter()
                           .Name("dynamiq_lossy_datagrams_total")
                           .Help("Datagrams of loss-tolerant all-reduces this node expected from each peer node "
                                 "(its contributions and its chunk's means), by outcome: arrived in time, or missed "
                                 "(lost, or late).")
                           .Register(*registry_)),
      lossy_late_(prometheus::BuildCounter()
                      .Name("dynamiq_lossy_late_total")
                      .Help("Contributions to loss-tolerant all-reduces that arrived after their phase's deadline "
                            "(not used).")
                      .Register(*registry_)),
      lossy_dropped_(prometheus::BuildCounter()
                         .Name("dynamiq_lossy_dropped_total")
                         .Help("Datagrams refused during loss-tolerant all-reduces: malformed, unauthenticated, "
                               "foreign, replayed, stray or repeated.")
                         .Register(*registry_)),
      lossy_coverage_(prometheus::BuildHistogram()
                          .Name("dynamiq_lossy_coverage")
                          .Help("Per loss-tolerant all-reduce, the fraction of the other nodes' contributions to "
                                "this node's chunk that arrived by the deadline.")
                          .Register(*registry_)),
      lossy_kept_own_(prometheus::BuildCounter()
                          .Name("dynamiq_lossy_kept_own_elements_total")
                          .Help("Elements of loss-tolerant all-reduce results that kept this node's own values "
                                "(another node's means did not arrive): where nodes' results differ.")
                          .Register(*registry_)),
      lossy_drift_(prometheus::BuildGauge()
                       .Name("dynamiq_lossy_drift_elements")
                       .Help("Elements that kept this node's own values since the job's last exact all-reduce "
                             "(sync_state's, the reliable resync).")
                       .Register(*registry_)),
      rejected_(prometheus::BuildCounter()
                    .Name("dynamiq_rejected_requests_total")
                    .Help("Worker and operator requests refused, by gRPC code.")
                    .Register(*registry_)),
      inflight_(prometheus::BuildGauge()
                    .Name("dynamiq_inflight_collectives")
                    .Help("Collectives submitted by some local worker and not finished.")
                    .Register(*registry_)),
      workers_(prometheus::BuildGauge()
                   .Name("dynamiq_connected_workers")
                   .Help("Registered local workers.")
                   .Register(*registry_)),
      view_nodes_(prometheus::BuildGauge()
                      .Name("dynamiq_job_nodes")
                      .Help("Nodes in the job's group view: those its collectives run on.")
                      .Register(*registry_)),
      live_nodes_(prometheus::BuildGauge()
                      .Name("dynamiq_cluster_live_nodes")
                      .Help("Nodes the coordinator heard from within the heartbeat timeout.")
                      .Register(*registry_)),
      membership_(prometheus::BuildCounter()
                      .Name("dynamiq_membership_changes_total")
                      .Help("Nodes that went silent (change=left), were heard from again (change=returned) or "
                            "joined again (change=restarted), as this node learned from the coordinator's live sets.")
                      .Register(*registry_)),
      peer_connections_(prometheus::BuildCounter()
                            .Name("dynamiq_peer_connections_total")
                            .Help("Connections to other nodes that group views' transports made (outcome=made) or kept "
                                  "from the view before (outcome=kept); --transport=tcp.")
                            .Register(*registry_)),
      epoch_(prometheus::BuildGauge()
                 .Name("dynamiq_config_epoch")
                 .Help("The job's current compression config epoch.")
                 .Register(*registry_)),
      compression_info_(prometheus::BuildGauge()
                            .Name("dynamiq_job_compression_info")
                            .Help("The job's active compression (value 1).")
                            .Register(*registry_)),
      budget_target_(prometheus::BuildGauge()
                         .Name("dynamiq_error_budget_target_vnmse")
                         .Help("The job's error budget: the vNMSE its controller keeps the measured error under (only "
                               "jobs under a budget).")
                         .Register(*registry_)),
      budget_bits_(prometheus::BuildGauge()
                       .Name("dynamiq_error_budget_bits")
                       .Help("The DynamiQ average bit budget in force for a job under an error budget.")
                       .Register(*registry_)),
      budget_measured_(prometheus::BuildGauge()
                           .Name("dynamiq_error_budget_measured_vnmse")
                           .Help("The latest error sample the job's controller used (coordinator node only).")
                           .Register(*registry_)),
      budget_saturated_(prometheus::BuildGauge()
                            .Name("dynamiq_error_budget_saturated")
                            .Help("1 when the job's controller is at max_bits and the error is still above target "
                                  "(coordinator node only).")
                            .Register(*registry_)),
      budget_events_(prometheus::BuildCounter()
                         .Name("dynamiq_error_budget_events_total")
                         .Help("Error-budget controller events by kind: raise, lower, clamp (published decisions), "
                               "rejected (not published), policy (controller started) (coordinator node only).")
                         .Register(*registry_)),
      shm_bytes_(prometheus::BuildGauge()
                     .Name("dynamiq_shm_mapped_bytes")
                     .Help("Shared-memory bytes allocated to local workers.")
                     .Register(*registry_)
                     .Add({})),
      rings_(prometheus::BuildGauge()
                 .Name("dynamiq_submission_rings")
                 .Help("Local workers whose all-reduces come through a submission ring in shared memory "
                       "(the others make one gRPC call each).")
                 .Register(*registry_)
                 .Add({})),
      store_keys_(prometheus::BuildGauge()
                      .Name("dynamiq_coordinator_store_keys")
                      .Help("Keys in the coordinator's store (coordinator node only).")
                      .Register(*registry_)),
      store_bytes_(prometheus::BuildGauge()
                       .Name("dynamiq_coordinator_store_bytes")
                       .Help("Bytes of the keys and values in the coordinator's store (coordinator node only).")
                       .Register(*registry_)) {
  prometheus::BuildGauge()
      .Name("dynamiq_build_info")
      .Help("The build (value 1).")
      .Register(*registry_)
      .Add({{"version", std::string(BuildVersion())}, {"git_commit", std::string(BuildGitCommit())}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("dynamiq_nodes")
      .Help("Nodes in the cluster.")
      .Register(*registry_)
      .Add({})
      .Set(num_nodes);
  prometheus::BuildGauge()
      .Name("dynamiq_node_rank")
      .Help("This node's rank.")
      .Register(*registry_)
      .Add({})
      .Set(node_rank);
  for (absl::StatusCode code : kRejectReasons) rejected_.Add({{"reason", ReasonLabel(code)}});
  collector_ = std::make_shared<Collector>(this);
}

Metrics::~Metrics() { StopServing(); }

absl::StatusOr<std::string> Metrics::Serve(const std::string& host, int port) {
  if (port < 0 || port > 65535) return absl::InvalidArgumentError(absl::StrCat("metrics port ", port, " is invalid"));
  absl::MutexLock lock(&exposer_mu_);
  if (exposer_) return absl::FailedPreconditionError("metrics are already served");
  const std::string bind = host.empty() ? absl::StrCat(port) : absl::StrCat(host, ":", port);
  try {
    // civetweb gives every connection a thread until its request is answered. Several threads, and
    // a bound on the time a request may take to arrive, so that a few idle or trickling connections
    // cannot keep Prometheus from scraping (it would see the node as down).
    exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", bind, "num_threads", absl::StrCat(kExposerThreads), "request_timeout_ms",
        absl::StrCat(absl::ToInt64Milliseconds(kScrapeRequestTimeout)), "enable_keep_alive", "no"});
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", bind,
                                               " (address in use? --metrics_port=0 picks a free port): ", e.what()));
  }
  std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty()) {
    exposer_.reset();
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", bind));
  }
  exposer_->RegisterCollectable(collector_);
  return absl::StrCat(host.empty() ? "0.0.0.0" : host, ":", ports[0]);
}

void Metrics::StopServing() {
  std::unique_ptr<prometheus::Exposer> exposer;
  {
    absl::MutexLock lock(&exposer_mu_);
    exposer = std::move(exposer_);
  }
  exposer.reset();  // civetweb joins its threads: no scrape runs after this
}

void Metrics::SetGaugeSource(GaugeSource source) {
  absl::MutexLock lock(&refresh_mu_);
  source_ = std::move(source);
}

std::string Metrics::Render() { return prometheus::TextSerializer().Serialize(collector_->Collect()); }

std::string Metrics::TopologyLabel(engine::Topology topology) const {
  return num_nodes_ <= 1 ? "local" : std::string(engine::TopologyName(topology));
}

std::string Metrics::BitsLabel(double bits) { return absl::StrFormat("%g", bits); }

std::string Metrics::ReasonLabel(absl::StatusCode code) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(code));
}

void Metrics::EnsureJob(const std::string& job, const kernels::CodecConfig& codec, engine::Topology topology) {
  const std::string codec_name(kernels::CodecName(codec.id));
  const std::string topology_name = TopologyLabel(topology);
  std::set<std::string>& seen = known_[job];
  const bool first = seen.empty();
  if (!seen.insert(absl::StrCat(codec_name, "|", topology_name)).second) return;
  if (first) {
    for (FaultKind kind : kFaults) faults_.Add({{"job", job}, {"kind", std::string(FaultKindName(kind))}});
    error_samples_.Add({{"job", job}});
  }
  for (CollectiveResult result : kResults) {
    collectives_.Add({{"job", job},
                      {"codec", codec_name},
                      {"topology", topology_name},
                      {"transport", transport_label_},
                      {"result", std::string(CollectiveResultName(result))}});
  }
}

void Metrics::OnCollective(const std::string& job, const CollectiveOutcome& o) {
  absl::MutexLock lock(&mu_);
  EnsureJob(job, o.codec, o.topology);
  const std::string codec(kernels::CodecName(o.codec.id));
  const std::string topology = TopologyLabel(o.topology);
  collectives_
      .Add({{"job", job},
            {"codec", codec},
            {"topology", topology},
            {"transport", transport_label_},
            {"result", std::string(CollectiveResultName(o.result))}})
      .Increment();
  if (o.result != CollectiveResult::kOk) {
    if (o.fault != FaultKind::kNone) {
      faults_.Add({{"job", job}, {"kind", std::string(FaultKindName(o.fault))}}).Increment();
    }
    return;
  }
  const prometheus::Labels labels{{"job", job}, {"codec", codec}, {"topology", topology}};
  duration_.Add(labels, DurationBuckets()).Observe(o.seconds);
  const uint64_t payload = o.num_elements * sizeof(float);
  payload_bytes_.Add(labels).Increment(static_cast<double>(payload));
  bus_bytes_.Add(labels).Increment(static_cast<double>(BusBytes(payload, o.nodes)));
  wire_bytes_.Add(labels).Increment(static_cast<double>(o.wire_bytes));
}

void Metrics::OnStragglerWait(const std::string& job, const StragglerWait& wait) {
  absl::MutexLock lock(&mu_);
  if (wait.local_rank.has_value()) {
    const prometheus::Labels labels{{"job", job}, {"local_rank", absl::StrCat(*wait.local_rank)}};
    local_wait_.Add(labels).Increment(wait.local_seconds);
    local_last_.Add(labels).Increment();
  }
  if (wait.node.has_value()) {
    const prometheus::Labels labels{{"job", job}, {"node", absl::StrCat(*wait.node)}};
    node_wait_.Add(labels).Increment(wait.node_seconds);
    node_last_.Add(labels).Increment();
  }
}

void Metrics::OnLossyCollective(const std::string& job, const LossyOutcome& o) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < o.peers.size(); ++i) {
    const std::string peer = absl::StrCat(o.peers[i]);
    lossy_datagrams_.Add({{"job", job}, {"peer", peer}, {"outcome", "arrived"}})
        .Increment(static_cast<double>(o.arrived[i]));
    lossy_datagrams_.Add({{"job", job}, {"peer", peer}, {"outcome", "missed"}})
        .Increment(static_cast<double>(o.expected[i] - std::min(o.expected[i], o.arrived[i])));
  }
  const prometheus::Labels labels{{"job", job}};
  lossy_late_.Add(labels).Increment(static_cast<double>(o.late));
  lossy_dropped_.Add(labels).Increment(static_cast<double>(o.dropped));
  lossy_coverage_.Add(labels, Histogram::BucketBoundaries{0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999, 1})
      .Observe(o.coverage);
  lossy_kept_own_.Add(labels).Increment(static_cast<double>(o.kept_own_elements));
}

void Metrics::OnErrorSample(const std::string& job, const SampledError& sample) {
  absl::MutexLock lock(&mu_);
  vnmse_
      .Add({{"job", job},
            {"codec", std::string(kernels::CodecName(sample.codec.id))},
            {"bits", BitsLabel(sample.codec.bits)}},
           VnmseBuckets())
      .Observe(sample.vnmse);
  error_samples_.Add({{"job", job}}).Increment();
}

void Metrics::OnErrorBudgetEvent(const std::string& job, absl::string_view kind) {
  absl::MutexLock lock(&mu_);
  budget_events_.Add({{"job", job}, {"kind", std::string(kind)}}).Increment();
}

void Metrics::RetireJob(const std::string& job) {
  bool serving;
  {
    absl::MutexLock lock(&exposer_mu_);
    serving = exposer_ != nullptr;
  }
  absl::MutexLock lock(&mu_);
  // Nobody collects (no endpoint, or nothing scrapes it for a long time): remove at once rather
  // than keep every retired job's series.
  if (!serving || retired_.size() >= 256) {
    RemoveJobSeries(job);
    for (const std::string& j : retired_) RemoveJobSeries(j);
    retired_.clear();
    return;
  }
  retired_.insert(job);
}

namespace {

// Removes the series of `family` whose job label is `job`.
template <typename T, typename... Args>
void RemoveSeries(prometheus::Family<T>& family, const std::string& job, Args&&... args) {
  for (const prometheus::MetricFamily& collected : family.Collect()) {
    for (const prometheus::ClientMetric& metric : collected.metric) {
      prometheus::Labels labels;
      for (const prometheus::ClientMetric::Label& l : metric.label) labels[l.name] = l.value;
      auto it = labels.find("job");
      if (it == labels.end() || it->second != job) continue;
      family.Remove(&family.Add(labels, args...));  // Add returns the existing series
    }
  }
}

}  // namespace

void Metrics::RemoveJobSeries(const std::string& job) {
  for (auto* family : {&collectives_, &payload_bytes_, &bus_bytes_, &wire_bytes_, &error_samples_, &faults_,
                       &budget_events_, &local_wait_, &local_last_, &node_wait_, &node_last_, &lossy_datagrams_,
                       &lossy_late_, &lossy_dropped_, &lossy_kept_own_}) {
    RemoveSeries(*family, job);
  }
  for (auto* family : {&duration_, &vnmse_, &lossy_coverage_})
    RemoveSeries(*family, job, Histogram::BucketBoundaries{});
  known_.erase(job);
}

void Metrics::RemoveGauge(prometheus::Family<prometheus::Gauge>& family, const prometheus::Labels& labels) {
  if (family.Has(labels)) family.Remove(&family.Add(labels));
}

void Metrics::OnMembershipChange(absl::string_view change, uint32_t nodes) {
  membership_.Add({{"change", std::string(change)}}).Increment(nodes);
}

void Metrics::OnPeerConnections(uint64_t made, uint64_t kept) {
  peer_connections_.Add({{"outcome", "made"}}).Increment(static_cast<double>(made));
  peer_connections_.Add({{"outcome", "kept"}}).Increment(static_cast<double>(kept));
}

void Metrics::OnRejected(absl::StatusCode code) { rejected_.Add({{"reason", ReasonLabel(code)}}).Increment(); }

void Metrics::AddPeerBytes(int peer, bool sent, uint64_t bytes) {
  if (peer < 0 || static_cast<uint32_t>(peer) >= num_nodes_) return;
  Counter* counter;
  {
    absl::MutexLock lock(&mu_);
    if (peer_counters_.size() < num_nodes_) peer_counters_.resize(num_nodes_, {nullptr, nullptr});
    Counter*& slot = peer_counters_[peer][sent ? 1 : 0];
    if (slot == nullptr) {
      slot = &peer_bytes_.Add({{"peer", absl::StrCat(peer)}, {"direction", sent ? "sent" : "received"}});
    }
    counter = slot;
  }
  counter->Increment(static_cast<double>(bytes));
}

void Metrics::Refresh() {
  absl::MutexLock lock(&refresh_mu_);
  const Snapshot snapshot = source_ ? source_() : Snapshot{};
  std::set<std::string> present;
  for (const JobGauges& j : snapshot.jobs) present.insert(j.job);
  {
    absl::MutexLock push_lock(&mu_);
    // Retired before the previous collection, which exported their final values; a job that is
    // live again keeps its series.
    for (const std::string& job : expiring_) {
      if (!present.count(job)) RemoveJobSeries(job);
    }
    expiring_ = std::move(retired_);
    retired_.clear();
    for (const JobGauges& j : snapshot.jobs) EnsureJob(j.job, j.config.codec, j.config.topology);
  }
  if (!source_) return;  // no state to pull (the gauges keep their last values)
  shm_bytes_.Set(static_cast<double>(snapshot.shm_mapped_bytes));
  rings_.Set(static_cast<double>(snapshot.submission_rings));
  if (snapshot.store_keys.has_value()) store_keys_.Add({}).Set(static_cast<double>(*snapshot.store_keys));
  if (snapshot.store_bytes.has_value()) store_bytes_.Add({}).Set(static_cast<double>(*snapshot.store_bytes));
  if (snapshot.live_nodes.has_value()) live_nodes_.Add({}).Set(*snapshot.live_nodes);
  for (const JobGauges& j : snapshot.jobs) {
    const prometheus::Labels job{{"job", j.job}};
    inflight_.Add(job).Set(j.inflight);
    workers_.Add(job).Set(j.workers);
    view_nodes_.Add(job).Set(j.view_nodes);
    epoch_.Add(job).Set(static_cast<double>(j.config_epoch));
    const prometheus::Labels info{{"job", j.job},
                                  {"codec", std::string(kernels::CodecName(j.config.codec.id))},
                                  {"bits", BitsLabel(j.config.codec.bits)},
                                  {"topology", TopologyLabel(j.config.topology)}};
    auto old = info_labels_.find(j.job);
    if (old != info_labels_.end() && old->second != info) compression_info_.Remove(&compression_info_.Add(old->second));
    compression_info_.Add(info).Set(1);
    info_labels_[j.job] = info;
    if (j.config.error_budget.has_value()) {
      budget_target_.Add(job).Set(j.config.error_budget->target_vnmse);
      budget_bits_.Add(job).Set(j.config.codec.bits);
    } else {
      RemoveGauge(budget_target_, job);
      RemoveGauge(budget_bits_, job);
    }
    if (j.lossy_drift_elements.has_value()) {
      lossy_drift_.Add(job).Set(static_cast<double>(*j.lossy_drift_elements));
    } else {
      RemoveGauge(lossy_drift_, job);
    }
    if (j.controller.has_value()) {
      budget_measured_.Add(job).Set(j.controller->last_vnmse);
      budget_saturated_.Add(job).Set(j.controller->saturated ? 1 : 0);
    } else {
      RemoveGauge(budget_measured_, job);
      RemoveGauge(budget_saturated_, job);
    }
  }
  // Jobs that are gone: their state gauges go too (their counters stay until RetireJob removes them).
  for (auto it = gauge_jobs_.begin(); it != gauge_jobs_.end();) {
    if (present.count(*it)) {
      ++it;
      continue;
    }
    const prometheus::Labels job{{"job", *it}};
    inflight_.Remove(&inflight_.Add(job));
    workers_.Remove(&workers_.Add(job));
    view_nodes_.Remove(&view_nodes_.Add(job));
    epoch_.Remove(&epoch_.Add(job));
    for (auto* family : {&budget_target_, &budget_bits_, &budget_measured_, &budget_saturated_, &lossy_drift_}) {
      RemoveGauge(*family, job);
    }
    auto info = info_labels_.find(*it);
    if (info != info_labels_.end()) {
      compression_info_.Remove(&compression_info_.Add(info->second));
      info_labels_.erase(info);
    }
    it = gauge_jobs_.erase(it);
  }
  gauge_jobs_.insert(present.begin(), present.end());
}

}  // namespace dynamiq::server
