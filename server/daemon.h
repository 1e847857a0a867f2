// Daemon: dynamiqd's core. Owns the node's shared memory (ShmRegistry), its jobs (Job), the
// worker API (gRPC on a Unix socket, mode 0600) and the operator API (gRPC on TCP: Control,
// grpc.health.v1, reflection, and on the coordinator node the Rendezvous service).
//
// Cluster: with num_nodes > 1 every daemon joins through the coordinator (node 0's daemon unless
// --coordinator names another address) and learns the same membership; each job's cross-node
// transport (tcp, gloo or nccl) rendezvous through the coordinator's store under "job/<id>/inc<k>/gen<g>".
// Compression changes are published in that store ("job/<id>/inc<k>/config/<epoch>") with the
// sequence they apply at (one after the job's next collective on the node that took the call), and
// every node polls for them before each collective, so all nodes switch at the same boundary.
// A node that fails a collective for a local reason (its workers disagree, its watchdog fires, a
// worker leaves, the job stops there) writes why under "job/<id>/inc<k>/failed/<sequence>" before
// it breaks the group; the nodes whose part of that collective is then cut short read it, so every
// node's workers get the cause, not just a reset connection.
//
// Job lifetime: a job exists on a node from the registration of its first local worker until its
// last local worker leaves (unregisters or dies); then it is retired: stopped, its reducer joined,
// its transport closed, its status and metrics gone (its last flight-recorder records stay readable
// for a while). Incarnations: each node counts how many times it has created job <id>, in the
// coordinator's store ("job/<id>/node<r>/incarnations", so the count survives a daemon restart),
// and the k-th creation is incarnation k, whose keys are all under "job/<id>/inc<k>/". Rule: a job id
// is reused by restarting all its workers on all nodes (every node retires the job, then creates
// it again), so every node is at the same incarnation without any extra coordination. A node whose
// workers never registered under an incarnation, or that kept its workers while the others
// restarted, is out of step: its collectives fail (the error names both incarnations); restart the
// job under a new id, or all of it again. A restarted coordinator starts every count afresh
// (its store is in memory), consistently for all nodes.
//
// GPU nodes (DaemonOptions::device = kCuda, dynamiqd --device=cuda; built with CUDA and NCCL only):
// workers may also ask for buffers in the daemon's device memory (DeviceBufferRegistry, shared
// through CUDA IPC handles), every job reduces on the device (a CudaDataPath, server/data_path.h) and its
// cross-node transport is an engine::NcclTransport rendezvousing under the same keys as Gloo's.
// Every node of a cluster must run the same --device (compared by the coordinator as a node joins).
//
// Implemented in server/daemon.cc (start-up, shutdown, jobs, operator calls) and
// server/daemon_workers.cc (the worker API: registration, buffers, all-reduce calls).
//
// Thread-safe. Start once, Shutdown once (also from a signal-watching thread).
#ifndef DQ_SERVER_DAEMON_H_
#define DQ_SERVER_DAEMON_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/env.h"
#include "common/thread_pool.h"
#include "engine/store.h"
#include "ipc/device_buffers.h"
#include "ipc/node_buffers.h"
#include "ipc/peer_credentials.h"
#include "ipc/shm_registry.h"
#include "server/daemon_options.h"
#include "server/job.h"
#include "server/job_config.h"
#include "server/retired_recorders.h"
#include "server/security.h"
#include "server/worker_rings.h"

namespace grpc {
class Server;
}

namespace dynamiq::ipc {
class ProcessWatcher;
class WorkerListener;
}  // namespace dynamiq::ipc

namespace dynamiq::server {

class Cluster;
class ControlService;
class ErrorBudgetService;
class JobObserverList;
class Metrics;
class RejectLog;
class RendezvousService;
class WorkerService;

class Daemon {
 public:
  explicit Daemon(DaemonOptions options);
  ~Daemon();

  // Starts the gRPC servers, joins the cluster. Returns once the node is ready for workers (gRPC
  // health then says SERVING; NOT_SERVING before). Waiting for the coordinator and the other nodes
  // takes up to --timeout, with a line on stderr every 5 s saying what it waits for.
  absl::Status Start();
  // Makes a Start() that waits for the cluster (or node 0's settings) return CANCELLED within about
  // a second. Thread-safe: for a signal-watching thread, while Start runs.
  void CancelStart();
  // Stops taking work, fails in-flight collectives, releases shared memory. Idempotent.
  void Shutdown(absl::Duration grace = absl::Seconds(5));
  // Blocks until Shutdown.
  void Wait();

  // The bound operator address (with the real port when `listen` asked for port 0).
  std::string listen_address() const;
  // The bound metrics address (host:port, GET /metrics); empty when metrics are off.
  std::string metrics_address() const;
  // The error sample rate in force: node 0's (read from the coordinator's store at Start).
  double error_sample_rate() const;
  // The node's metrics (always recorded; served only with metrics_port >= 0).
  Metrics& metrics() { return *metrics_; }
  // Counts a refused worker or operator request (dynamiq_rejected_requests_total) and logs it with
  // `who` sent it (at most 20 lines per 10 s; the next line says how many were left out). OK is
  // ignored.
  void RecordRejected(const absl::Status& status, absl::string_view who);
  const DaemonOptions& options() const { return options_; }

  // Worker API, called by the gRPC service.
  struct Registration {
    uint64_t worker_id = 0;
    uint64_t config_epoch = 0;
    JobConfig config;
  };
  // `peer`: the worker's process (from SO_PEERCRED); when given, the daemon unregisters the worker
  // as soon as that process exits.
  absl::StatusOr<Registration> Register(const std::string& job_id, uint32_t local_rank, uint32_t local_world_size,
                                        std::optional<ipc::PeerCredentials> peer = std::nullopt);
  absl::StatusOr<ipc::ShmBufferInfo> Allocate(uint64_t worker_id, size_t bytes);
  // A device buffer (GPU nodes only: FAILED_PRECONDITION on a --device=cpu daemon).
  absl::StatusOr<ipc::DeviceBufferInfo> AllocateDevice(uint64_t worker_id, size_t bytes);
  // The UUID of the daemon's CUDA device (empty on a CPU daemon).
  const std::string& device_uuid() const { return device_uuid_; }
  absl::Status Mapped(uint64_t worker_id, uint64_t buffer_id);
  absl::Status Release(uint64_t worker_id, uint64_t buffer_id);
  absl::Status Unregister(uint64_t worker_id);
  // The credentials of the worker connection gRPC calls `grpc_peer` (ServerContext::peer()).
  std::optional<ipc::PeerCredentials> WorkerPeer(const std::string& grpc_peer) const;
  // PERMISSION_DENIED when `caller` (a call's peer, if known) is not the process that registered
  // `worker_id`: ids start at 1 in every dynamiqd, so a worker left over from an earlier daemon on
  // the same socket would otherwise release a new worker's buffers or unregister it. OK for an
  // unknown worker (the call's own checks say so) or caller.
  absl::Status CheckCaller(uint64_t worker_id, const std::optional<ipc::PeerCredentials>& caller) const;
  struct AllReduceCall {
    uint64_t worker_id = 0;
    std::string tensor_name;
    uint64_t buffer_id = 0;
    uint64_t offset_bytes = 0;
    uint64_t num_elements = 0;
    kernels::DType dtype = kernels::DType::kFloat32;
    bool average = false;
    std::optional<uint64_t> submission;
    std::optional<double> weight;  // Job::Request::weight
    bool exact = false;            // Job::Request::exact
  };
  // Queues a worker's all-reduce and returns at once: `done` runs exactly once with the result or
  // the error (Job::Enqueue), here for a refused request. The worker service's handler.
  void AllReduceAsync(const AllReduceCall& call, Job::Completion done);
  // Answers a refused all-reduce call with `why` (counted and logged). A numbered one
  // (`submission`) of a registered worker keeps its place in the job (Job::Request::refused), so
  // the collective fails for every local worker instead of stalling the worker's next ones.
  void RefuseAllReduce(const AllReduceCall& call, const absl::Status& why, Job::Completion done);
  // The element type a request's dynamiq.v1.DType number names; INVALID_ARGUMENT for others.
  static absl::StatusOr<kernels::DType> WireDType(int dtype);
  // Creates the worker's submission ring (ipc/submission_ring_server.h), the shared-memory path for
  // its all-reduces, and serves it until the worker leaves. `slots` 0: kDefaultRingSlots.
  // FAILED_PRECONDITION for a worker not registered, ALREADY_EXISTS for a second ring,
  // INVALID_ARGUMENT for more than ipc::ring::kMaxSlots slots.
  static constexpr uint32_t kDefaultRingSlots = 64;
  struct RingInfo {
    std::string shm_name;
    size_t bytes = 0;
    uint32_t slots = 0;
  };
  absl::StatusOr<RingInfo> OpenSubmissionRing(uint64_t worker_id, uint32_t slots);

  // Operator API. A compression change maps the job's newest configuration (the newest published
  // epoch, staged or applied) to the new one; it runs on this node while the change claims the next
  // epoch, so changes made at once through different nodes each build on the one before.
  using CompressionChange = std::function<absl::StatusOr<JobConfig>(const JobConfig& newest)>;
  // A config with an error budget puts the job under the coordinator's controller
  // (FAILED_PRECONDITION when no error samples would be taken, or on a one-node cluster); one
  // without ends it. `expected_epoch`: ABORTED unless the job's newest epoch is that (unset: any).
  // An unknown job is NOT_FOUND, after `change` was checked against the daemon's defaults.
  absl::StatusOr<PublishedChange> SetCompression(const std::string& job_id, const CompressionChange& change,
                                                 std::optional<uint64_t> expected_epoch);
  // Claims the job's next group view, of the nodes `members` (Job::ChangeView): it applies on every
  // node at a collective boundary a few collectives on. NOT_FOUND when the job does not run here.
  absl::StatusOr<GroupView> ChangeView(const std::string& job_id, std::vector<uint32_t> members);
  // The coordinator's error-budget controllers (server/error_budget_service.h); null on other nodes.
  ErrorBudgetService* error_budget() { return error_budget_.get(); }
  // The live jobs (a retired job is not listed).
  std::map<std::string, Job::Status> JobStatuses() const;
  // The jobs whose flight recorder can be read: the live ones, then the retired ones still kept.
  std::vector<std::string> RecordedJobs() const;
  // The live job's records, else those of the job's last retired incarnation while kept.
  absl::StatusOr<std::vector<CollectiveRecord>> FlightRecorder(const std::string& job_id, size_t limit) const;
  std::vector<std::string> members() const;
  // The nodes the coordinator last said are live (server/membership.h); empty without heartbeats.
  std::vector<uint32_t> LiveNodes() const;

 private:
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const std::string& job_id) const;
  // Removes a worker; `reason` says why (in the errors of the collectives that fail with it). The
  // job's last local worker retires the job (RetireJob).
  absl::Status RemoveWorker(uint64_t worker_id, const std::string& reason);
  // Adds a worker to a live job (registered in jobs_).
  absl::StatusOr<Registration> AddWorker(Job& job, const std::string& job_id, uint32_t local_rank,
                                         uint32_t local_world_size, const std::optional<ipc::PeerCredentials>& peer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new Job for incarnation `incarnation` of `job_id` (its reducer starts at once).
  // `rejoin_after_view`: Job::Options::rejoin_after_view.
  absl::StatusOr<std::shared_ptr<Job>> CreateJob(const std::string& job_id, uint64_t incarnation,
                                                 uint32_t local_world_size,
                                                 std::optional<uint64_t> rejoin_after_view = std::nullopt);
  // Closes a job already taken out of jobs_ (no worker left) and drops its per-job state.
  void RetireJob(std::shared_ptr<Job> job, const std::string& reason);
  // FAILED_PRECONDITION unless the worker is registered.
  absl::Status CheckRegistered(uint64_t worker_id) const;
  // The id of the job the worker registered with; FAILED_PRECONDITION for a worker not registered.
  absl::StatusOr<std::string> JobOfWorker(uint64_t worker_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Start on a GPU node: checks the device and sets up its buffer registry.
  absl::Status OpenDevice();
  // Validates an all-reduce call and turns it into the job's request (errors are rejections).
  absl::StatusOr<Job::Request> CheckAllReduce(const AllReduceCall& call, std::shared_ptr<Job>* job);
  // A submission from a worker's ring, run as AllReduceAsync runs the RPC's.
  void SubmitFromRing(uint64_t worker_id, const ipc::ring::RingRequest& request, WorkerRings::Reply reply);
  const DaemonOptions options_;
  ServerSecurity security_;                           // loaded by Start; outlives the services that use it
  std::unique_ptr<ipc::NodeBuffers> buffers_;         // workers' shared memory (and device memory on GPU nodes)
  std::string device_uuid_;                           // set by Start on GPU nodes
  std::unique_ptr<Metrics> metrics_;                  // outlives the jobs, which report into it
  std::unique_ptr<RejectLog> reject_log_;             // RecordRejected
  std::unique_ptr<ErrorBudgetService> error_budget_;  // node 0 only; outlives the jobs too
  std::unique_ptr<JobObserverList> observers_;        // what jobs report to: metrics (+ error budget)
  std::shared_ptr<common::ThreadPool> codec_pool_;    // CPU nodes with codec_threads > 1; created by Start
  std::unique_ptr<RendezvousService> rendezvous_;     // coordinator node only
  std::unique_ptr<Cluster> cluster_;                  // the coordinator protocol; created by Start
  std::unique_ptr<grpc::Server> operator_server_;
  std::unique_ptr<grpc::Server> worker_server_;
  std::unique_ptr<ipc::WorkerListener> worker_listener_;
  std::unique_ptr<ipc::ProcessWatcher> process_watcher_;
  std::unique_ptr<WorkerService> worker_service_;
  std::unique_ptr<WorkerRings> rings_;  // the workers' submission rings
  std::unique_ptr<ControlService> control_service_;
  std::string peer_host_;

  // Serialises job creation (which claims an incarnation from the coordinator) without holding mu_
  // over that call. Taken before mu_.
  absl::Mutex create_mu_;
  mutable absl::Mutex mu_;
  // The live jobs. Handlers hold a reference while they use a job, so Shutdown and retirement can
  // drop it from the map safely. Invariant: every id in worker_jobs_ is here (until Shutdown).
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  RetiredRecorders retired_;  // the last retired jobs' flight recorders (kept 8)
  std::map<uint64_t, std::string> worker_jobs_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> worker_watches_ ABSL_GUARDED_BY(mu_);  // worker id -> ProcessWatcher handle
  std::map<uint64_t, pid_t> worker_pids_ ABSL_GUARDED_BY(mu_);        // worker id -> its process (when known)
  uint64_t next_worker_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Serialises this node's SetCompression calls without blocking the worker API while they talk
  // to the coordinator.
  absl::Mutex config_mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> start_cancelled_{false};
  // Nodes other than the coordinator's: polls the coordinator once a second and joins it again
  // when it has restarted (an empty rendezvous that does not know this node). Ends at Shutdown.
  void WatchCoordinator();
  std::thread coordinator_watch_;
  // Clusters with heartbeats (server/membership.h): heartbeats to the coordinator every quarter of
  // --heartbeat_timeout, logs and counts changes of the live set, and hands it to every job
  // (Job::OnMembership). Ends at Shutdown.
  void WatchMembership();
  std::thread membership_watch_;
  std::string listen_address_ ABSL_GUARDED_BY(mu_);
  std::string metrics_address_ ABSL_GUARDED_BY(mu_);
  double error_sample_rate_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_DAEMON_H_
