// Daemon: dynamiqd's core. Owns the node's shared memory (ShmRegistry), its jobs (Job), the
// worker API (gRPC on a Unix socket, mode 0600) and the operator API (gRPC on TCP: Control,
// grpc.health.v1, reflection, and on the coordinator node the Rendezvous service).
//
// Cluster: with num_nodes > 1 every daemon joins through the coordinator (node 0's daemon unless
// --coordinator names another address) and learns the same membership; each job's cross-node
// transport (Gloo TCP) rendezvous through the coordinator's store under "job/<id>/gen<g>".
// Compression changes are published in that store with the sequence they apply at (one after the
// job's next collective on the node that took the call), and every node polls for them before each
// collective, so all nodes switch at the same boundary.
//
// Thread-safe. Start once, Shutdown once (also from a signal-watching thread).
#ifndef DQ_SERVER_DAEMON_H_
#define DQ_SERVER_DAEMON_H_

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/store.h"
#include "server/job.h"
#include "server/peer_credentials.h"
#include "server/security.h"
#include "server/shm_registry.h"

namespace grpc {
class Server;
}

namespace dynamiq::server {

class ControlService;
class ErrorBudgetService;
class JobObserverList;
class Metrics;
class ProcessWatcher;
class WorkerListener;
class RendezvousService;
class WorkerService;

struct DaemonOptions {
  uint32_t node_rank = 0;
  uint32_t num_nodes = 1;
  // host:port of the coordinator's gRPC server; empty: node 0 serves it on `listen`.
  std::string coordinator;
  // Operator / peer gRPC address (TCP). Its host is also the address Gloo binds for peers.
  std::string listen = "127.0.0.1:7070";
  std::string worker_socket = "/tmp/dynamiq/dynamiqd.sock";
  JobConfig default_config;
  absl::Duration timeout = absl::Seconds(300);
  // Shared memory limits.
  size_t max_shm_bytes = size_t{64} << 30;
  // Prometheus /metrics port on the host of `listen`: 0 picks a free one, -1 serves none (the
  // default here, so in-process daemons never collide; dynamiqd's flag defaults to 9400).
  int metrics_port = -1;
  // Fraction (0..1) of compressed cross-node collectives whose error is measured (see
  // server/error_probe.h). Node 0's value applies to the whole cluster.
  double error_sample_rate = 0.01;
  // Operator token, cluster secret and TLS files (server/security.h, docs/security.md); unset: off.
  SecurityOptions security;
};

class Daemon {
 public:
  explicit Daemon(DaemonOptions options);
  ~Daemon();

  // Starts the gRPC servers, joins the cluster. Returns once the node is ready for workers.
  absl::Status Start();
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
  // Counts a refused worker or operator request (dynamiq_rejected_requests_total); OK is ignored.
  void RecordRejected(const absl::Status& status);
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
                                        std::optional<PeerCredentials> peer = std::nullopt);
  absl::StatusOr<ShmBufferInfo> Allocate(uint64_t worker_id, size_t bytes);
  absl::Status Mapped(uint64_t worker_id, uint64_t buffer_id);
  absl::Status Release(uint64_t worker_id, uint64_t buffer_id);
  absl::Status Unregister(uint64_t worker_id);
  // The credentials of the worker connection gRPC calls `grpc_peer` (ServerContext::peer()).
  std::optional<PeerCredentials> WorkerPeer(const std::string& grpc_peer) const;
  struct AllReduceCall {
    uint64_t worker_id = 0;
    std::string tensor_name;
    uint64_t buffer_id = 0;
    uint64_t offset_bytes = 0;
    uint64_t num_elements = 0;
    kernels::DType dtype = kernels::DType::kFloat32;
    bool average = false;
    std::optional<uint64_t> submission;
  };
  absl::StatusOr<Job::Result> AllReduce(const AllReduceCall& call);

  // Operator API. A config with an error budget puts the job under the coordinator's controller
  // (FAILED_PRECONDITION when no error samples would be taken: rate 0); one without ends it.
  // `expected_epoch`: ABORTED unless the job is at that epoch (unset: any).
  absl::StatusOr<uint64_t> SetCompression(const std::string& job_id, const JobConfig& config,
                                          std::optional<uint64_t> expected_epoch);
  // The coordinator's error-budget controllers (server/error_budget_service.h); null on other nodes.
  ErrorBudgetService* error_budget() { return error_budget_.get(); }
  std::map<std::string, Job::Status> JobStatuses() const;
  absl::StatusOr<std::vector<CollectiveRecord>> FlightRecorder(const std::string& job_id, size_t limit) const;
  std::vector<std::string> members() const;

 private:
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const std::string& job_id) const;
  // Removes a worker; `reason` says why (in the errors of the collectives that fail with it).
  absl::Status RemoveWorker(uint64_t worker_id, const std::string& reason);
  Job* GetOrCreateJob(const std::string& job_id, uint32_t local_world_size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<bool> PollConfig(const std::string& job_id, uint64_t sequence, uint64_t* epoch, JobConfig* config);
  // Multi-node: node 0 publishes its error sample rate in the coordinator's store, the others adopt it.
  absl::Status AgreeOnErrorSampleRate();
  // Validates an all-reduce call and turns it into the job's request (errors are rejections).
  absl::StatusOr<Job::Request> CheckAllReduce(const AllReduceCall& call, std::shared_ptr<Job>* job);

  const DaemonOptions options_;
  ServerSecurity security_;  // loaded by Start; outlives the services that use it
  std::unique_ptr<ShmRegistry> registry_;
  std::unique_ptr<Metrics> metrics_;                  // outlives the jobs, which report into it
  std::unique_ptr<ErrorBudgetService> error_budget_;  // node 0 only; outlives the jobs too
  std::unique_ptr<JobObserverList> observers_;        // what jobs report to: metrics (+ error budget)
  std::unique_ptr<RendezvousService> rendezvous_;     // coordinator node only
  std::unique_ptr<engine::Store> store_;              // the coordinator's store (local when single-node)
  std::unique_ptr<grpc::Server> operator_server_;
  std::unique_ptr<grpc::Server> worker_server_;
  std::unique_ptr<WorkerListener> worker_listener_;
  std::unique_ptr<ProcessWatcher> process_watcher_;
  std::unique_ptr<WorkerService> worker_service_;
  std::unique_ptr<ControlService> control_service_;
  std::string peer_host_;

  mutable absl::Mutex mu_;
  // Handlers hold a reference while they use a job, so Shutdown can drop the map safely.
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::string> worker_jobs_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> worker_watches_ ABSL_GUARDED_BY(mu_);  // worker id -> ProcessWatcher handle
  uint64_t next_worker_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Serialises this node's SetCompression calls without blocking the worker API while they talk
  // to the coordinator.
  absl::Mutex config_mu_;
  std::vector<std::string> members_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // Nodes other than the coordinator's: polls the coordinator once a second and joins it again
  // when it has restarted (an empty rendezvous that does not know this node). Ends at Shutdown.
  void WatchCoordinator();
  std::thread coordinator_watch_;
  std::string listen_address_ ABSL_GUARDED_BY(mu_);
  std::string metrics_address_ ABSL_GUARDED_BY(mu_);
  double error_sample_rate_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_DAEMON_H_
