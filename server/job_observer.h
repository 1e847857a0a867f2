// JobObserver: what a Job reports while it runs, for metrics (server/metrics.h implements it; a
// job without an observer reports nothing). Kept as a small interface so Job does not depend on
// Prometheus.
//
// Contract for implementations: thread-safe, fast, and never calling back into the job. Jobs call
// them from the reducer thread and from gRPC handler threads, sometimes with the job's own lock
// held, so an implementation may only take leaf locks of its own.
#ifndef DQ_SERVER_JOB_OBSERVER_H_
#define DQ_SERVER_JOB_OBSERVER_H_

#include <stdint.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/schedule.h"
#include "kernels/codec.h"
#include "server/job_config.h"

namespace dynamiq::server {

// How a collective ended (the `result` label of dynamiq_collectives_total).
enum class CollectiveResult { kOk, kError, kTimeout, kAborted };
// Why it failed (the `kind` label of dynamiq_faults_total); kNone for a successful one.
enum class FaultKind { kNone, kTimeout, kAbort, kPeerFailure, kMismatch };

absl::string_view CollectiveResultName(CollectiveResult result);  // "ok", "error", "timeout", "aborted"
absl::string_view FaultKindName(FaultKind kind);                  // "timeout", "abort", "peer_failure", ...

// Classifies the status a collective failed with. `stopping`: the job was being stopped (shutdown),
// which makes any failure an abort. DEADLINE_EXCEEDED is a timeout; ABORTED/CANCELLED an abort;
// INVALID_ARGUMENT/FAILED_PRECONDITION a mismatch (local workers or a peer's step header disagree,
// a peer announced an impossible size); anything else (a peer gone or reset, a corrupted payload,
// no memory) an error of kind peer_failure.
struct Classification {
  CollectiveResult result;
  FaultKind fault;
};
Classification ClassifyFailure(const absl::Status& status, bool stopping);

// nccl-tests bus bytes of an all-reduce of `payload_bytes` over `num_nodes` ranks:
// payload x 2(n-1)/n (0 on a single node).
uint64_t BusBytes(uint64_t payload_bytes, uint32_t num_nodes);

// One finished collective as the job reports it.
struct CollectiveOutcome {
  CollectiveResult result = CollectiveResult::kOk;
  FaultKind fault = FaultKind::kNone;
  // The codec the cross-node all-reduce used: the job's, or none for tensors below
  // min_compress_elements.
  kernels::CodecConfig codec;
  engine::Topology topology = engine::Topology::kRing;
  uint64_t num_elements = 0;
  // Successful collectives only: from the moment all local workers had submitted to the result
  // being in their buffers, without the error probe's side all-reduce.
  double seconds = 0;
  uint64_t wire_bytes = 0;  // bytes this node sent for the cross-node all-reduce, headers included
  uint32_t nodes = 1;       // the nodes it ran over (its group view's members)
};

// One sampled collective's measured compression error (server/error_probe.h).
struct SampledError {
  JobConfig config;            // the job's configuration the collective ran under
  uint64_t config_epoch = 0;   // ... and its epoch
  kernels::CodecConfig codec;  // the codec it actually used (config's, or none below min_compress)
  double vnmse = 0;
};

// Whom a successful collective waited for (the straggler view).
struct StragglerWait {
  // The local worker that submitted last, and how long after the first one (0 with one worker).
  std::optional<uint32_t> local_rank;
  double local_seconds = 0;
  // The node whose local part was ready last, and how much later than this node's (0 when it is
  // this node); unset on one node, in large clusters, and at a node's first collective.
  std::optional<uint32_t> node;
  double node_seconds = 0;
};

// One loss-tolerant all-reduce (engine/lossy_all_reduce.h) as this node saw it.
struct LossyOutcome {
  // Per other node of the view (node ranks): the datagrams expected from it (its contributions to
  // this node's chunk and its chunk's means) and those that arrived in time.
  std::vector<uint32_t> peers;
  std::vector<uint64_t> expected, arrived;
  uint64_t late = 0;     // contributions that came after their deadline
  uint64_t dropped = 0;  // datagrams refused: malformed, unauthenticated, foreign, replayed, stray, repeated
  double coverage = 1;   // fraction of the contributions to this node's chunk that arrived
  // Elements of the result that kept this node's own values (means that did not arrive).
  uint64_t kept_own_elements = 0;
};

class JobObserver {
 public:
  virtual ~JobObserver() = default;
  // Every collective once, successful or not (including those failed by the watchdog, by a
  // worker leaving or by shutdown before they ran).
  virtual void OnCollective(const std::string& job, const CollectiveOutcome& outcome) = 0;
  // A sampled collective's measured compression error.
  virtual void OnErrorSample(const std::string& job, const SampledError& sample) = 0;
  // A worker request refused before it became part of a collective, with the code it got.
  virtual void OnRejected(absl::StatusCode code) = 0;
  // Whom a successful collective waited for.
  virtual void OnStragglerWait(const std::string& job, const StragglerWait& wait) {}
  // A successful loss-tolerant all-reduce.
  virtual void OnLossyCollective(const std::string& job, const LossyOutcome& outcome) {}
};

// Forwards every report to each of `observers` in order (e.g. the metrics and the error-budget
// controllers). The observers must outlive it.
class JobObserverList final : public JobObserver {
 public:
  explicit JobObserverList(std::vector<JobObserver*> observers) : observers_(std::move(observers)) {}
  void OnCollective(const std::string& job, const CollectiveOutcome& outcome) override {
    for (JobObserver* o : observers_) o->OnCollective(job, outcome);
  }
  void OnErrorSample(const std::string& job, const SampledError& sample) override {
    for (JobObserver* o : observers_) o->OnErrorSample(job, sample);
  }
  void OnRejected(absl::StatusCode code) override {
    for (JobObserver* o : observers_) o->OnRejected(code);
  }
  void OnStragglerWait(const std::string& job, const StragglerWait& wait) override {
    for (JobObserver* o : observers_) o->OnStragglerWait(job, wait);
  }
  void OnLossyCollective(const std::string& job, const LossyOutcome& outcome) override {
    for (JobObserver* o : observers_) o->OnLossyCollective(job, outcome);
  }

 private:
  const std::vector<JobObserver*> observers_;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_JOB_OBSERVER_H_
