// Metrics: dynamiqd's Prometheus metrics (names, labels and meaning: docs/metrics.md). Owns a
// prometheus::Registry with every dynamiq_* family and, once Serve() is called, a
// prometheus::Exposer (civetweb) answering GET /metrics on its own port.
//
// Counters and histograms are pushed as things happen: jobs report through JobObserver, transports
// through PeerBytesSink (server/counting_transport.h), the gRPC services through OnRejected.
// Gauges that describe state (workers, in-flight collectives, config epoch, active compression,
// mapped shared memory) are pulled at each scrape from a GaugeSource the daemon sets, so they are
// never stale and no code path has to remember to update them.
//
// Labels are bounded: job ids, codec names, bit settings, topologies, node ranks and fixed enums;
// never tensor names or sequence numbers. A job's label sets that can be known in advance (its
// fault kinds, its collective results under the current configuration, its error sample count) are
// created at zero when the job first appears, so rate() and alerts see them before the first event.
// A retired job's series, counters included, are removed after one more collection (RetireJob), so
// the job ids present are those of the jobs a node runs, not every id it ever ran.
//
// Thread-safe. Lock order: the scrape path holds `refresh_mu_` while it calls the GaugeSource
// (which takes daemon and job locks); the push paths (called with job locks held) only take leaf
// locks (`mu_`, then prometheus' own), never `refresh_mu_`. The pushed series (counters,
// histograms) are added, incremented and removed under `mu_`, so a removal never frees a series a
// push is about to increment.
#ifndef DQ_SERVER_METRICS_H_
#define DQ_SERVER_METRICS_H_

#include <stdint.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/labels.h"
#include "server/compression_controller.h"
#include "server/counting_transport.h"
#include "server/job.h"
#include "server/job_observer.h"

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace dynamiq::server {

// The /metrics server: threads, and how long a client may take to send its request (headers
// included) before the connection is closed.
inline constexpr int kExposerThreads = 8;
inline constexpr absl::Duration kScrapeRequestTimeout = absl::Seconds(5);

class Metrics final : public JobObserver, public PeerBytesSink {
 public:
  // The state gauges, read at every scrape.
  struct JobGauges {
    std::string job;
    uint32_t workers = 0;
    uint32_t inflight = 0;
    uint64_t config_epoch = 0;
    uint32_t view_nodes = 0;  // nodes in the job's group view (server/group_view.h)
    JobConfig config;
    // The job's error-budget controller, where this node runs it (the coordinator).
    std::optional<CompressionController::Stats> controller;
    // Jobs of the loss-tolerant all-reduce (or with drift left from one): elements that kept this
    // node's values since the last resync (Job::Status::lossy_drift_elements).
    std::optional<uint64_t> lossy_drift_elements;
  };
  struct Snapshot {
    std::vector<JobGauges> jobs;
    uint64_t shm_mapped_bytes = 0;
    uint32_t submission_rings = 0;  // workers' submission rings the daemon serves
    // The coordinator's store (node 0 of a cluster; unset elsewhere): its keys, and their bytes.
    std::optional<uint64_t> store_keys;
    std::optional<uint64_t> store_bytes;
    // Nodes the coordinator heard from within the heartbeat timeout (clusters with heartbeats).
    std::optional<uint32_t> live_nodes;
  };
  using GaugeSource = std::function<Snapshot()>;

  // `transport`: what moves this node's bytes to the others ("tcp", "gloo", "nccl"), the
  // collectives' `transport` label (single node: "local").
  Metrics(uint32_t node_rank, uint32_t num_nodes, std::string transport = "tcp");
  ~Metrics() override;
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves GET /metrics on `host`:`port` (port 0: a free port; host as in --listen, IPv6 in
  // brackets). Returns the bound "host:port". UNAVAILABLE when it cannot bind, FAILED_PRECONDITION
  // when already serving.
  absl::StatusOr<std::string> Serve(const std::string& host, int port);
  // Stops the HTTP server (idempotent); in-progress scrapes finish first.
  void StopServing();
  // Replaces the gauge source; nullptr stops pulling (gauges keep their last values). Waits for a
  // scrape that is using the old source.
  void SetGaugeSource(GaugeSource source);

  // The text exposition format, exactly what GET /metrics returns.
  std::string Render();

  // JobObserver.
  void OnCollective(const std::string& job, const CollectiveOutcome& outcome) override;
  void OnErrorSample(const std::string& job, const SampledError& sample) override;
  void OnRejected(absl::StatusCode code) override;
  void OnStragglerWait(const std::string& job, const StragglerWait& wait) override;
  void OnLossyCollective(const std::string& job, const LossyOutcome& outcome) override;
  // An error-budget controller event (server/error_budget_service.h): raise, lower, clamp, rejected, policy.
  void OnErrorBudgetEvent(const std::string& job, absl::string_view kind);
  // The coordinator's live set changed (server/membership.h): `change` is "left" (a node went
  // silent), "returned" or "restarted" (a new dynamiqd joined in its place), `nodes` how many did.
  void OnMembershipChange(absl::string_view change, uint32_t nodes);
  // A group view's transport connected (--transport=tcp, engine/tcp_mesh.h): `made` connections to
  // other nodes made for it, `kept` reused from the view before.
  void OnPeerConnections(uint64_t made, uint64_t kept);
  // The job was retired on this node (its last local worker left). Its series, counters included,
  // are removed at the second collection from now, so one scrape still sees its final values;
  // unless it is live again by then (a next incarnation), whose series then go on. At once when
  // metrics are not served.
  void RetireJob(const std::string& job) ABSL_LOCKS_EXCLUDED(mu_, exposer_mu_);
  // PeerBytesSink.
  void AddPeerBytes(int peer, bool sent, uint64_t bytes) override;

  // Label values as the metrics spell them.
  std::string TopologyLabel(engine::Topology topology) const;  // ring|butterfly; "local" on one node
  static std::string BitsLabel(double bits);                   // "%g": 5, 4.5, 0 for codecs without bits
  static std::string ReasonLabel(absl::StatusCode code);       // "invalid_argument", ...

 private:
  class Collector;
  // Creates the zero-valued label sets of a job seen for the first time (and of a configuration it
  // has not run under yet).
  void EnsureJob(const std::string& job, const kernels::CodecConfig& codec, engine::Topology topology)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes every series labelled job=`job` of the pushed (counter and histogram) families.
  void RemoveJobSeries(const std::string& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void RemoveGauge(prometheus::Family<prometheus::Gauge>& family, const prometheus::Labels& labels);
  // Pulls the gauges; called by the Collector before every collection.
  void Refresh() ABSL_LOCKS_EXCLUDED(refresh_mu_);

  const uint32_t node_rank_;
  const uint32_t num_nodes_;
  const std::string transport_label_;
  const std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Collector> collector_;

  prometheus::Family<prometheus::Counter>& collectives_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Family<prometheus::Counter>& payload_bytes_;
  prometheus::Family<prometheus::Counter>& bus_bytes_;
  prometheus::Family<prometheus::Counter>& wire_bytes_;
  prometheus::Family<prometheus::Histogram>& vnmse_;
  prometheus::Family<prometheus::Counter>& error_samples_;
  prometheus::Family<prometheus::Counter>& peer_bytes_;
  prometheus::Family<prometheus::Counter>& faults_;
  prometheus::Family<prometheus::Counter>& local_wait_;  // the straggler view, by local rank
  prometheus::Family<prometheus::Counter>& local_last_;
  prometheus::Family<prometheus::Counter>& node_wait_;  // ... and by node
  prometheus::Family<prometheus::Counter>& node_last_;
  // The loss-tolerant all-reduce: datagrams per peer node and outcome, late and dropped ones,
  // coverage, elements that kept this node's values (and since the last resync: a gauge).
  prometheus::Family<prometheus::Counter>& lossy_datagrams_;
  prometheus::Family<prometheus::Counter>& lossy_late_;
  prometheus::Family<prometheus::Counter>& lossy_dropped_;
  prometheus::Family<prometheus::Histogram>& lossy_coverage_;
  prometheus::Family<prometheus::Counter>& lossy_kept_own_;
  prometheus::Family<prometheus::Gauge>& lossy_drift_;
  prometheus::Family<prometheus::Counter>& rejected_;
  prometheus::Family<prometheus::Gauge>& inflight_;
  prometheus::Family<prometheus::Gauge>& workers_;
  prometheus::Family<prometheus::Gauge>& view_nodes_;
  prometheus::Family<prometheus::Gauge>& live_nodes_;          // one series, in clusters with heartbeats
  prometheus::Family<prometheus::Counter>& membership_;        // by change: left, returned
  prometheus::Family<prometheus::Counter>& peer_connections_;  // by outcome: made, kept
  prometheus::Family<prometheus::Gauge>& epoch_;
  prometheus::Family<prometheus::Gauge>& compression_info_;
  prometheus::Family<prometheus::Gauge>& budget_target_;
  prometheus::Family<prometheus::Gauge>& budget_bits_;
  prometheus::Family<prometheus::Gauge>& budget_measured_;
  prometheus::Family<prometheus::Gauge>& budget_saturated_;
  prometheus::Family<prometheus::Counter>& budget_events_;
  prometheus::Gauge& shm_bytes_;
  prometheus::Gauge& rings_;
  prometheus::Family<prometheus::Gauge>& store_keys_;   // one series, on the coordinator only
  prometheus::Family<prometheus::Gauge>& store_bytes_;  // likewise

  absl::Mutex mu_;  // leaf
  // job -> "codec|topology" label sets created at zero.
  std::map<std::string, std::set<std::string>> known_ ABSL_GUARDED_BY(mu_);
  // Per peer rank: [received, sent] counters, created on first use.
  std::vector<std::array<prometheus::Counter*, 2>> peer_counters_ ABSL_GUARDED_BY(mu_);
  // Jobs retired since the last collection; at a collection they move to `expiring_`, whose series
  // the next collection removes.
  std::set<std::string> retired_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> expiring_ ABSL_GUARDED_BY(mu_);

  absl::Mutex refresh_mu_;  // serialises scrapes, source changes and the gauges they own
  GaugeSource source_ ABSL_GUARDED_BY(refresh_mu_);
  // The state gauges' current label sets, so those of vanished jobs or old configs are removed.
  std::map<std::string, prometheus::Labels> info_labels_ ABSL_GUARDED_BY(refresh_mu_);
  std::set<std::string> gauge_jobs_ ABSL_GUARDED_BY(refresh_mu_);

  absl::Mutex exposer_mu_;
  std::unique_ptr<prometheus::Exposer> exposer_ ABSL_GUARDED_BY(exposer_mu_);
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_METRICS_H_
