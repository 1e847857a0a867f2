// Job: one training job on this node: its local workers, its compression configuration and the
// reducer thread that runs its collectives one at a time, in sequence order.
//
// Every worker's k-th AllReduce belongs to collective k of the job. When all local workers have
// submitted collective k, the reducer checks that they agree (tensor name, size, dtype), then runs
// it through the job's DataPath (server/data_path.h): the local fp32 sum of their buffers, the
// compressed all-reduce across nodes over the job's transport (whose step headers make every node
// check the same job, sequence and config epoch), and the write-back into every worker's buffer.
// Enqueue returns at once and completes the request then (Submit waits for it); on a one-node job
// the request that completes a small collective (up to 256 Ki elements) runs it itself when no
// other collective runs, sparing the hand-over to the reducer thread. The reducer also
// watches for stalls: a collective still incomplete --timeout after its first submission fails for
// every local worker of it, naming the local ranks that never submitted. CPU nodes use HostDataPath (shared memory, tcp
// or gloo, the error probe); GPU nodes pass a CudaDataPath (CUDA kernels, NCCL).
//
// Configuration changes (SetCompression) are staged with the sequence at which they apply; the
// coordinator's store carries them to every node (see Daemon), so all nodes switch at the same
// collective boundary, never mid-collective.
//
// Lifetime: the Daemon creates a Job when the first local worker of its id registers and retires it
// (Stop, Close) when the last one leaves. A job id registered again gets a new Job, the id's next
// incarnation on this node (Options::incarnation): its rendezvous and configuration keys are its
// own, and its step headers carry the incarnation, so nothing of an earlier run reaches it.
//
// Thread-safe: Enqueue and Submit are called from many gRPC threads.
#ifndef DQ_SERVER_JOB_H_
#define DQ_SERVER_JOB_H_

#include <stdint.h>

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "engine/schedule.h"
#include "engine/step_auth.h"
#include "engine/transport.h"
#include "kernels/codec.h"
#include "kernels/codec_cache.h"
#include "server/cross_node_group.h"
#include "server/data_path.h"
#include "server/job_config.h"
#include "server/job_coordinator.h"
#include "server/job_observer.h"
#include "server/membership.h"
#include "server/step_budget_planner.h"

namespace dynamiq::server {

// One collective as the flight recorder keeps it.
struct CollectiveRecord {
  uint64_t sequence = 0;
  std::string tensor_name;
  uint64_t num_elements = 0;
  JobConfig config;
  uint64_t config_epoch = 0;
  std::string state;  // running, ok, failed
  std::string error;
  absl::Time start;
  double seconds = 0;
  uint64_t wire_bytes = 0;
  uint64_t view_epoch = 0;
  std::vector<uint32_t> nodes;  // the view's members it ran on (this node alone on one node)
  uint64_t contributors = 0;    // workers summed (failed collectives: 0)
};

class Job {
 public:
  struct Options {
    std::string id;
    // How many times this node has created job `id`, this one included (Daemon): the k-th creation
    // on every node is incarnation k of the job.
    uint64_t incarnation = 1;
    uint32_t local_world_size = 1;
    uint32_t num_nodes = 1;
    uint32_t node_rank = 0;  // this node's rank among the num_nodes
    JobConfig config;
    absl::Duration timeout = absl::Seconds(300);
    // Required when num_nodes > 1; on one node it only carries configuration changes (null: none).
    // With num_nodes > 1, a node that fails a collective locally reports why before it breaks the
    // group, and a node whose cross-node part is then cut short (the connection reset, or its
    // deadline passed) looks the cause up, so every node's workers read what went wrong and where.
    std::shared_ptr<JobCoordinator> coordinator;
    size_t flight_recorder_size = 256;
    // Metrics; null: none. Must outlive the job.
    JobObserver* observer = nullptr;
    // Fraction of compressed cross-node collectives whose error is measured against an exact sum
    // (server/error_probe.h). Every node of the job must use the same rate. A config's error budget
    // may set its own (JobConfig::error_budget->sample_rate), agreed through its epoch.
    double error_sample_rate = 0;
    // arc_topk jobs keep EF21 error feedback per tensor (server/error_feedback.h), at most this many
    // bytes of it per job (8 per element of every tensor); the least recently used tensors' state
    // makes room for another.
    bool arc_topk_error_feedback = false;
    double arc_topk_momentum = 1.0;  // EF21M's eta in (0, 1]; 1: plain EF21
    size_t error_feedback_bytes = size_t{1} << 30;
    // Authenticates the cross-node engine messages (engine/step_auth.h); null: checksums only.
    std::shared_ptr<const engine::StepAuthenticator> authenticator;
    // Where collectives run (and `connect` must return transports it can drive). Null: a
    // HostDataPath (CPU node), whose codec work `codec_pool` splits (null: the reducer thread only).
    std::shared_ptr<DataPath> data_path;
    std::shared_ptr<common::ThreadPool> codec_pool;
    // One DynamiQ bit budget per training step (server/step_budget_planner.h): each bucket's
    // cross-node collective runs at its share of the job's b̄, planned from the previous step's
    // results. Every node of the job must agree (dynamiqd --step_budget, checked at startup). Data
    // paths that cannot read the result (GPU nodes) keep the job's b̄.
    bool step_budget = false;
    // The loss-tolerant all-reduce (a configuration's lossy_phase): bytes per second this node
    // sends datagrams at, at most (dynamiqd --udp_send_mbps; 0: unpaced).
    double lossy_send_bytes_per_second = 0;
    // A restarted node rejoining the job's running incarnation (Cluster::RejoinableIncarnation):
    // the epoch of the newest view when it asked, one without this node. Its first collective waits
    // (up to `timeout`) for a later view that admits it, and the node numbers its collectives as the
    // members do from that view's first collective on.
    std::optional<uint64_t> rejoin_after_view;
    // The live set when the job was created (Cluster::live): how many times each node had joined
    // then, so that a node restarted before the job's first look at the live set still counts as
    // restarted (OnMembership).
    LiveSet live_at_start;
  };

  struct Request {
    uint64_t worker_id = 0;
    uint64_t buffer_id = 0;
    std::string tensor_name;
    uint64_t num_elements = 0;
    kernels::DType dtype = kernels::DType::kFloat32;
    bool average = false;
    // Contribution accounting: the worker's weight (its sample count; finite, >= 0, 0 allowed). A
    // weighted collective's result is sum(w_i g_i), or with `average` sum(w_i g_i) / sum(w_i) (0
    // when every weight is 0), over every worker of every node; the sum of the weights travels
    // exactly, in fp64, beside the data (engine/side_lane.h). Every worker of a collective, on
    // every node, must submit with a weight or every one without. Unset: weight 1, and the mean
    // divides by the number of workers (no side lane on the wire).
    std::optional<double> weight;
    // Uncompressed whatever the job's compression (codec none): every worker of the collective, on
    // every node, submits it alike.
    bool exact = false;
    absl::Span<uint8_t> region;              // the worker's bytes (shared memory, or device memory if device_memory)
    std::shared_ptr<const void> buffer_use;  // keeps `region` from being released (BufferUse::hold)
    bool device_memory = false;              // region is a device buffer (only with a device data path)
    // The worker's own index of this request (0, 1, ... since it registered); unset: arrival order.
    std::optional<uint64_t> submission;
    // Not OK: the daemon refused this numbered request for this reason. It still takes its place
    // (its `done` gets the reason at once), and its collective fails for every local worker when
    // it runs, so the worker's later all-reduces are not left waiting behind a collective that
    // could never complete. (A refused request without `submission` is answered and forgotten.)
    absl::Status refused;
  };

  struct Result {
    uint64_t sequence = 0;
    uint64_t config_epoch = 0;
    JobConfig config;
    uint64_t wire_bytes = 0;
    std::optional<double> measured_vnmse;  // the error probe's figure when it sampled the collective
    // What was summed: the workers of every node that contributed, and the sum of their weights
    // (for an unweighted collective, the number of workers).
    uint64_t contributors = 0;
    double weight_sum = 0;
    std::vector<uint32_t> nodes;  // the nodes whose workers took part (the view's members), by rank
  };

  explicit Job(Options options);
  ~Job();  // Close()

  const std::string& id() const { return options_.id; }
  uint64_t incarnation() const { return options_.incarnation; }
  // The configuration of epoch 0, before any change.
  const JobConfig& initial_config() const { return options_.config; }

  // Adds a local worker; INVALID_ARGUMENT for a rank outside the job's local world size or a
  // different local world size than earlier workers said, ALREADY_EXISTS for a taken rank. `pid`
  // (0: unknown) is the worker's process, named by the watchdog when the worker stalls.
  absl::Status AddWorker(uint64_t worker_id, uint32_t local_rank, uint32_t local_world_size, int64_t pid = 0);
  // Removes a worker (unregistered or dead): queued collectives fail with `reason`; returns once
  // no running collective uses its buffers any more (they may then be unmapped).
  void RemoveWorker(uint64_t worker_id, const std::string& reason);
  // Fails queued requests (with `reason`, else "job <id> is shutting down"), aborts a running
  // collective, rejects new ones, and waits until every accepted request has completed. Idempotent.
  void Stop(const std::string& reason = "");
  // Stop, then joins the reducer thread and closes the transport: what is left is the job's status
  // and flight recorder. Called by the destructor; idempotent; never from the reducer thread.
  void Close();

  // Called once per request with its result (then in request.region) or its error.
  using Completion = std::function<void(absl::StatusOr<Result>)>;
  // Queues the worker's next collective and returns once it is queued, or, for a small one-node
  // collective this request completes, once it ran here. `done` runs exactly once: on this
  // thread for a refused request, else on the thread that completes the collective (the reducer,
  // this or another Enqueue, or RemoveWorker/Stop for one they fail). It must not block for long
  // nor call into the Job. The request, with its buffer hold, moves into the job, which lets go of
  // the hold before `done` runs (the worker may release the buffer once it has the answer).
  void Enqueue(Request request, Completion done);
  // Enqueue, then waits for the completion.
  absl::StatusOr<Result> Submit(const Request& request);

  // Stages a configuration change; returns the epoch it gets (local only: the Daemon publishes it).
  struct Status {
    uint64_t incarnation = 0;
    uint32_t workers = 0;
    uint64_t config_epoch = 0;
    JobConfig config;
    uint32_t inflight = 0;
    // Cumulative since the job started on this node (dynamiqctl top turns them into rates).
    uint64_t completed = 0;       // collectives that succeeded
    uint64_t failed = 0;          // collectives that failed (reducer, watchdog, a worker leaving, shutdown)
    uint64_t payload_bytes = 0;   // successful collectives' elements x 4
    uint64_t bus_bytes = 0;       // payload x 2(n-1)/n over n nodes
    uint64_t wire_bytes = 0;      // sent for the cross-node all-reduces, headers included
    double duration_seconds = 0;  // successful collectives' time, as dynamiq_collective_duration_seconds
    uint64_t error_samples = 0;   // collectives whose compression error was measured
    uint64_t config_polls = 0;    // collectives that asked the coordinator for a configuration change
    double last_vnmse = 0;        // the latest measured vNMSE (when error_samples > 0)
    // The straggler view: seconds successful collectives waited for each local rank (its
    // submission after the first one's) and for each node (its part after this node's).
    std::map<uint32_t, double> local_wait_seconds;
    std::map<uint32_t, double> node_wait_seconds;
    // The loss-tolerant all-reduce: datagrams expected from the other nodes and those that arrived
    // in time, and the elements that kept this node's values since the last exact all-reduce.
    uint64_t lossy_expected = 0;
    uint64_t lossy_arrived = 0;
    uint64_t lossy_drift_elements = 0;
    // The group view the next collective runs in (server/group_view.h), as far as this node knows.
    uint64_t view_epoch = 0;
    std::vector<uint32_t> view_members;
  };
  Status GetStatus() const;
  std::vector<CollectiveRecord> FlightRecorder(size_t limit) const;
  // The sequence the reducer will run next (SetCompression applies one after it).
  uint64_t NextSequence() const;
  // The boundary a configuration change published now applies at: two collectives after the one
  // the reducer runs next (another node can be at most one collective ahead). This node then asks
  // the coordinator for changes at every collective up to it, and tells the other nodes to (the
  // side lane, server/contributions.h), which otherwise skip that round trip.
  uint64_t ReserveConfigBoundary();
  // Claims the job's next group view, of `members` (node ranks), from this node's configuration
  // boundary on (ReserveConfigBoundary: the side lane tells every node to look for it there, and
  // every member switches at that collective). The view claimed (another node's, if one claimed the
  // same epoch first); FAILED_PRECONDITION on one node or when a newer view exists already.
  absl::StatusOr<GroupView> ChangeView(std::vector<uint32_t> members);
  // What a live set (server/membership.h) does to the job here. Members that are gone (silent, or
  // restarted: their count of joins moved on) abort the transport if it connects them, and the
  // view's lowest remaining member claims the next view without them, from the first collective it
  // has not completed, unless fewer than min_nodes would remain; live nodes outside the view that
  // ask to join (a restarted node rejoining: Options::rejoin_after_view) are admitted by that member
  // in a view from its configuration boundary on. The view this node claimed, if it did. The
  // daemon's heartbeat thread calls it after every heartbeat; with every member live and nobody
  // outside the view it reads nothing.
  std::optional<GroupView> OnMembership(const LiveSet& live);

 private:
  struct Entry {
    Request request;
    uint32_t local_rank = 0;
    absl::Time arrived;
    absl::Time stall_deadline;  // its collective fails if it has not started by then
    Completion done;
  };
  struct Slot {
    std::map<uint32_t, std::unique_ptr<Entry>> entries;  // by local rank
    bool running = false;                                // the reducer owns the entries until it completes them
  };
  // Entries taken out of their slots under mu_, to complete once it is released: their buffer
  // holds are let go first (as a handler's frame did), then their completions run, so a worker
  // that has its answer can release its buffer at once.
  struct Completions {
    std::vector<std::unique_ptr<Entry>> entries;
    std::vector<absl::StatusOr<Result>> results;  // one per entry
    bool empty() const { return entries.empty(); }
  };

  void ReducerLoop();
  // The collective that runs next if every local worker has submitted it and nothing runs it yet.
  Slot* NextComplete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Claims a view of `members` after `newest` from this node's configuration boundary on, holding
  // the reducer before the collective ahead of the boundary until the claim is in the coordinator's
  // store (or failed): the other nodes finish that collective only once this one runs it, so no
  // node reaches the boundary and looks for the view before it can be read.
  absl::StatusOr<GroupView> ClaimAtBoundary(const GroupView& newest, std::vector<uint32_t> members);
  uint64_t ReserveConfigBoundaryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A claim holds the collective that runs next (ClaimAtBoundary).
  bool HeldForClaim() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rejoining node's first collective, `sequence` in its own numbering: waits (up to --timeout)
  // for a view that admits this node, then renumbers its queued collectives so that this one is the
  // view's first. The collective's sequence from then on (unchanged when not admitted: it fails as
  // a non-member's, and the next one waits again).
  uint64_t AwaitAdmission(uint64_t sequence);
  // Runs `completions`, then counts them done (Stop waits for that). Without mu_ held.
  void Complete(Completions completions);
  // Takes every entry of `slot` into `out`, each to complete with `result` (the slot is then empty).
  static void TakeSlot(Slot& slot, const absl::StatusOr<Result>& result, Completions& out);
  // The stall check: fails every waiting collective whose first submission is --timeout old, as the
  // watchdog of each request; their failures for the other nodes go to `failures`.
  void ExpireStalled(Completions& out, CrossNodeGroup::Failures& failures) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // When ExpireStalled has something to do next (InfiniteFuture: nothing waits).
  absl::Time NextStall() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs collective `sequence` over the complete slot and completes every entry of it.
  void RunCollective(uint64_t sequence, Slot& slot);
  // The configuration and epoch collective `sequence` runs with: a published change whose boundary
  // it is, and a new group view, are looked up and adopted where the job polls (the lookup talks
  // to the coordinator: call it without mu_).
  void AdoptBoundaryChanges(uint64_t sequence, JobConfig* config, uint64_t* epoch) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the local workers' submissions of collective `sequence` agree: the status every one
  // of them fails with otherwise (a refused submission, or two that differ, named).
  absl::Status CheckLocalAgreement(uint64_t sequence, const std::vector<Entry*>& entries) const;
  // The end of a collective: takes its entries' completions into `completions`, records it, drops
  // its slot, advances the job and counts it.
  void Finish(uint64_t sequence, const absl::Status& status, const Result& result, CollectiveRecord record,
              const DataPath::CrossNodeResult& cross, double seconds, const StragglerWait& waits, uint32_t nodes,
              Completions& completions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cross-node step of a collective whose local sum is ready: the job's transport and codec,
  // then the data path's all-reduce (and error probe). The tensor's name and the workers' dtype
  // identify the collective on the wire. A failure drops the group (re-formed at the next one).
  // `weighted` marks the collective's id; `side_sums` is its side lane (server/contributions.h),
  // summed over the nodes in place.
  // The loss-tolerant all-reduce of collective `sequence` over the view's datagram transport
  // (config.lossy_phase > 0): every node ends it by its deadlines, whatever arrived.
  // Its datagrams announce `boundary` (this node's configuration boundary) as the side lane would.
  absl::StatusOr<DataPath::CrossNodeResult> CrossNodeLossy(uint64_t sequence, const JobConfig& config,
                                                           absl::string_view tensor_name, kernels::DType dtype,
                                                           size_t n, uint64_t boundary);
  // After a successful cross-node step: counts the drift a loss-tolerant one left (an exact one
  // resets it) and reports what arrived.
  void ReportLossy(const GroupView& view, bool exact, const DataPath::CrossNodeResult& cross);
  absl::StatusOr<DataPath::CrossNodeResult> CrossNode(uint64_t sequence, const JobConfig& config, uint64_t epoch,
                                                      absl::string_view tensor_name, kernels::DType dtype, size_t n,
                                                      double bits, bool weighted, absl::Span<double> side_sums);
  // The codec collectives of `num_elements` use across nodes (none below min_compress_elements).
  static kernels::CodecConfig EffectiveCodec(const JobConfig& config, uint64_t num_elements);
  // Counts a failed collective and reports it to the observer.
  void CountFailure(uint64_t num_elements, Classification how) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Record(CollectiveRecord record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CrossNodeGroup::WithRemoteCause, unless the job is stopping (then the failure is its own).
  absl::Status WithRemoteCause(uint64_t sequence, absl::Status error);
  // "1 (pid 4242), 3 (not registered)": the local ranks of `slot` that have not submitted.
  std::string MissingRanks(const Slot& slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const std::shared_ptr<DataPath> path_;  // options_.data_path, or a HostDataPath
  mutable absl::Mutex mu_;
  std::map<uint64_t, uint32_t> workers_ ABSL_GUARDED_BY(mu_);      // worker id -> local rank
  std::map<uint64_t, int64_t> pids_ ABSL_GUARDED_BY(mu_);          // worker id -> process id (if known)
  std::map<uint64_t, uint64_t> next_submit_ ABSL_GUARDED_BY(mu_);  // worker id -> its next sequence
  std::map<uint64_t, uint64_t> base_ ABSL_GUARDED_BY(mu_);         // worker id -> the sequence of its submission 0
  std::map<uint64_t, Slot> slots_ ABSL_GUARDED_BY(mu_);            // sequence -> submissions
  uint64_t next_run_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  Status totals_ ABSL_GUARDED_BY(mu_);  // the cumulative fields of GetStatus
  JobConfig config_ ABSL_GUARDED_BY(mu_);
  uint64_t config_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool joining_ ABSL_GUARDED_BY(mu_) = false;  // rejoining, not admitted yet (Options::rejoin_after_view)
  std::string stop_reason_ ABSL_GUARDED_BY(mu_);
  std::deque<CollectiveRecord> records_ ABSL_GUARDED_BY(mu_);
  uint64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;  // accepted requests not yet completed
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;     // requests accepted so far (wakes the stall check)
  // A collective runs (one at a time): on the reducer thread, or on the thread whose request
  // completed it (Enqueue, small one-node collectives). That thread alone uses the state marked
  // "running thread only" below; claiming and releasing it under mu_ hands that state over.
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  // The job's group view and cross-node transport: used by the running thread, aborted by Stop.
  CrossNodeGroup group_;
  absl::Time deadline_;  // of the collective that runs (running thread only)
  // When this node's previous collective ended (running thread only; unset before the first).
  std::optional<absl::Time> previous_end_;
  // Ask the coordinator for a configuration change before the next collective (running thread
  // only): the first one, after a failed one, where the side lane has no node slots, or when a
  // node's boundary (ReserveConfigBoundary, its own or through the side lane) reaches it.
  bool poll_next_ = true;
  uint64_t config_boundary_ ABSL_GUARDED_BY(mu_) = 0;              // ReserveConfigBoundary's latest
  std::multiset<uint64_t> claim_boundaries_ ABSL_GUARDED_BY(mu_);  // of the claims on their way (ClaimAtBoundary)
  // How many times each member of the view had joined the cluster when this job first saw it in
  // that view: a count that moved on is a restarted node, gone as surely as a silent one.
  absl::Mutex membership_mu_;
  std::map<uint32_t, uint64_t> generations_ ABSL_GUARDED_BY(membership_mu_);
  uint64_t generations_view_ ABSL_GUARDED_BY(membership_mu_) = ~uint64_t{0};  // the view they were seen in
  kernels::CodecCache codecs_;                                                // running thread only
  // arc_topk's error feedback per tensor, dropped at every config epoch change (running thread only).
  ErrorFeedback error_feedback_;
  uint64_t error_feedback_epoch_ = 0;
  StepBudgetPlanner planner_;   // running thread only (options_.step_budget)
  uint64_t planner_epoch_ = 0;  // the config epoch planner_ plans for (running thread only)
  absl::Mutex close_mu_;        // serialises Close (the reducer is joined once)
  std::thread reducer_ ABSL_GUARDED_BY(close_mu_);
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_JOB_H_
