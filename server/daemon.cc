#include "server/daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/cluster.h"
#include "server/control_service.h"
#ifdef DQ_HAVE_NCCL
#include "server/cuda_device.h"
#endif
#include "ipc/process_watcher.h"
#include "ipc/shm_region.h"
#include "ipc/worker_listener.h"
#include "server/cluster_job_coordinator.h"
#include "server/error_budget_service.h"
#include "server/grpc_store.h"
#include "server/metrics.h"
#include "server/reject_log.h"
#include "server/rendezvous_service.h"
#include "server/request_names.h"
#include "server/worker_service.h"

namespace dynamiq::server {
namespace {

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

Daemon::Daemon(DaemonOptions options) : options_(std::move(options)) {
  ipc::ShmRegistry::Options shm;
  shm.max_total_bytes = options_.max_shm_bytes;
  shm.max_total_buffers = options_.max_buffers;
  buffers_ = std::make_unique<ipc::NodeBuffers>(shm);
  // The collectives' transport label names what really moves the bytes (it said "gloo" always).
  metrics_ = std::make_unique<Metrics>(options_.node_rank, options_.num_nodes, TransportName(options_));
  reject_log_ = std::make_unique<RejectLog>(*metrics_);
  rings_ = std::make_unique<WorkerRings>(
      [this](uint64_t worker_id, const ipc::ring::RingRequest& request, WorkerRings::Reply reply) {
        SubmitFromRing(worker_id, request, std::move(reply));
      },
      [this](const absl::Status& status, absl::string_view who) { RecordRejected(status, who); });
  std::vector<JobObserver*> observers = {metrics_.get()};
  if (options_.node_rank == 0) {
    // Every node measures the same error samples: node 0 runs the controllers and publishes their
    // decisions like an operator's change, conditional on the epoch they were based on.
    error_budget_ = std::make_unique<ErrorBudgetService>(
        [this](const std::string& job, const JobConfig& config, uint64_t expected_epoch) -> absl::StatusOr<uint64_t> {
          DQ_ASSIGN_OR_RETURN(PublishedChange published,
                              SetCompression(
                                  job, [&config](const JobConfig&) { return config; }, expected_epoch));
          return published.epoch;
        },
        [this](const ErrorBudgetService::Event& e) {
          metrics_->OnErrorBudgetEvent(e.job, e.kind);
          common::Log("job %s: error budget %s: %s", e.job.c_str(), e.kind.c_str(), e.reason.c_str());
        });
    observers.push_back(error_budget_.get());
  }
  observers_ = std::make_unique<JobObserverList>(std::move(observers));
}

Daemon::~Daemon() { Shutdown(absl::Seconds(1)); }

absl::Status Daemon::Start() {
  // Buffers a crashed daemon created but never unlinked (their worker never reported mapping them).
  if (const size_t orphans = ipc::ShmRegion::UnlinkOrphans(); orphans > 0) {
    common::Log("removed %zu shared-memory objects left in /dev/shm by dynamiqd processes that no longer run", orphans);
  }
  DQ_RETURN_IF_ERROR(ValidateDaemonOptions(options_));
  if (options_.device == DeviceKind::kCpu && options_.codec_threads > 1) {
    codec_pool_ = std::make_shared<common::ThreadPool>(options_.codec_threads);
  }
  const bool coordinator_here = options_.coordinator.empty() && options_.node_rank == 0;
  // GPU nodes: the device itself, before anything is bound.
  if (options_.device == DeviceKind::kCuda) DQ_RETURN_IF_ERROR(OpenDevice());
  // Token, secret and TLS files: a bad one stops the daemon here, naming the flag (server/security.h).
  DQ_ASSIGN_OR_RETURN(security_, LoadServerSecurity(options_.security, options_.num_nodes));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  // Operator (and coordinator) server on TCP.
  control_service_ = std::make_unique<ControlService>(*this, security_.operator_auth.get());
  grpc::ServerBuilder op;
  int port = 0;
  op.AddListeningPort(options_.listen, security_.server_credentials, &port);
  // gRPC sets SO_REUSEPORT by default: a second daemon on the same port would start and share the
  // operator calls with this one. Off, it fails at start like the worker socket and metrics port.
  op.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Nodes ping the coordinator while a call is open (server/grpc_store.cc): let them, however often
  // this server sends no data (gRPC's default closes a connection pinged more than every 5 min).
  op.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  op.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  op.RegisterService(control_service_.get());
  // The rendezvous of a cluster: a single node has none (a node pointed at it is told so).
  if (coordinator_here && options_.num_nodes > 1) {
    rendezvous_ = std::make_unique<RendezvousService>(
        security_.rendezvous_auth.get(), [this](const absl::Status& s) { RecordRejected(s, "a rendezvous call"); });
    // A node whose settings differ from this one's is refused as it joins, and never listed.
    rendezvous_->RequireSettings(ClusterSettings(options_));
    if (options_.heartbeat_timeout > absl::ZeroDuration()) {
      rendezvous_->EnableHeartbeats(options_.heartbeat_timeout, options_.min_nodes);
    }
    op.RegisterService(rendezvous_.get());
  }
  operator_server_ = op.BuildAndStart();
  if (!operator_server_ || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen, " (address in use?)"));
  }
  peer_host_ = HostOf(options_.listen);
  {
    absl::MutexLock lock(&mu_);
    listen_address_ = absl::StrCat(peer_host_, ":", port);
  }
  // Not ready (gRPC health NOT_SERVING, for readiness probes) until the cluster has formed and the
  // workers' socket is up: Start ends with SERVING.
  operator_server_->GetHealthCheckService()->SetServingStatus("dynamiq.v1.Control", false);
  operator_server_->GetHealthCheckService()->SetServingStatus(false);  // "" too

  // The coordinator protocol: an in-process store for a single node, else node 0's over gRPC.
  Cluster::Options cluster;
  cluster.node_rank = options_.node_rank;
  cluster.num_nodes = options_.num_nodes;
  const std::string me = listen_address();
  cluster.coordinator = coordinator_here ? me : options_.coordinator;
  cluster.timeout = options_.timeout;
  cluster.cancelled = [this] { return start_cancelled_.load(); };
  cluster.settings = ClusterSettings(options_);
  std::unique_ptr<Cluster> formed;
  if (options_.num_nodes == 1) {
    formed = Cluster::Local(std::move(cluster), me);
  } else {
    auto coordinator =
        std::make_unique<GrpcStore>(cluster.coordinator, security_.channel_credentials, security_.rendezvous_token);
    DQ_ASSIGN_OR_RETURN(formed, Cluster::Join(std::move(cluster), std::move(coordinator), me));
  }
  {
    absl::MutexLock lock(&mu_);  // members() (operators' GetStatus) reads it meanwhile
    cluster_ = std::move(formed);
  }
  DQ_ASSIGN_OR_RETURN(const double rate, cluster_->AgreeOnErrorSampleRate(options_.error_sample_rate));
  {
    absl::MutexLock lock(&mu_);
    error_sample_rate_ = rate;
  }
  if (options_.num_nodes > 1) {
    DQ_RETURN_IF_ERROR(AgreeOnClusterAuthentication(cluster_->store(), options_.node_rank,
                                                    !security_.cluster_secret.empty(), options_.timeout));
  }

  // Worker server on a Unix socket only the owner can reach: mode 0600, and every connection's
  // SO_PEERCRED uid checked before gRPC sees it (WorkerListener hands accepted sockets to gRPC).
  process_watcher_ = std::make_unique<ipc::ProcessWatcher>();
  worker_service_ = std::make_unique<WorkerService>(*this);
  grpc::ServerBuilder wb;
  wb.RegisterService(worker_service_.get());
  worker_server_ = wb.BuildAndStart();
  if (!worker_server_) return absl::UnavailableError("cannot start the worker gRPC server");
  // A refused connection (another uid) counts as a rejected request.
  DQ_ASSIGN_OR_RETURN(
      worker_listener_,
      ipc::WorkerListener::Start(options_.worker_socket, worker_server_.get(), [this](const absl::Status& s) {
        RecordRejected(s, "a connection to the worker socket");
      }));

  // Metrics: state gauges are read at every scrape.
  metrics_->SetGaugeSource([this] {
    Metrics::Snapshot snapshot;
    for (const auto& [id, s] : JobStatuses()) {
      Metrics::JobGauges gauges{
          id, s.workers, s.inflight, s.config_epoch, static_cast<uint32_t>(s.view_members.size()), s.config};
      if (error_budget_) {
        if (auto state = error_budget_->State(id)) gauges.controller = state->stats;
      }
      if (s.config.lossy_phase > absl::ZeroDuration() || s.lossy_drift_elements > 0) {
        gauges.lossy_drift_elements = s.lossy_drift_elements;
      }
      snapshot.jobs.push_back(std::move(gauges));
    }
    snapshot.shm_mapped_bytes = buffers_->TotalMappedBytes();
    snapshot.submission_rings = static_cast<uint32_t>(rings_->size());
    if (options_.num_nodes > 1 && options_.heartbeat_timeout > absl::ZeroDuration()) {
      const LiveSet live = cluster_->live();
      if (live.epoch > 0) snapshot.live_nodes = static_cast<uint32_t>(live.live.size());
    }
    if (rendezvous_) {
      snapshot.store_keys = rendezvous_->KeyCount();
      snapshot.store_bytes = rendezvous_->KeyBytes();
    }
    return snapshot;
  });
  if (options_.metrics_port >= 0) {
    DQ_ASSIGN_OR_RETURN(std::string address, metrics_->Serve(peer_host_, options_.metrics_port));
    absl::MutexLock lock(&mu_);
    metrics_address_ = std::move(address);
  }
  if (options_.num_nodes > 1 && !coordinator_here) {
    coordinator_watch_ = std::thread([this] { WatchCoordinator(); });
  }
  if (options_.num_nodes > 1 && options_.heartbeat_timeout > absl::ZeroDuration()) {
    membership_watch_ = std::thread([this] { WatchMembership(); });
  }
  operator_server_->GetHealthCheckService()->SetServingStatus(true);
  return absl::OkStatus();
}

void Daemon::CancelStart() { start_cancelled_ = true; }

void Daemon::WatchCoordinator() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shut_down_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopped), absl::Seconds(1))) return;
    }
    absl::StatusOr<bool> rejoined = cluster_->RejoinIfForgotten();
    if (!rejoined.ok() || !*rejoined) continue;
    std::vector<std::shared_ptr<Job>> stale;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, job] : jobs_) stale.push_back(job);
    }
    // The restarted coordinator lost these jobs' rendezvous, incarnations and failure causes: none
    // of their collectives can complete any more. Say so at once to the workers that stayed
    // registered, instead of letting them time out.
    for (const std::shared_ptr<Job>& job : stale) {
      const std::string reason = absl::StrCat(
          "job ", job->id(), " (incarnation ", job->incarnation(),
          ") cannot go on: the coordinator (node 0) restarted and lost its state; restart the job's workers on "
          "every node (they register a new incarnation)");
      common::Log("%s", reason.c_str());
      job->Stop(reason);
    }
  }
}

void Daemon::WatchMembership() {
  const absl::Duration interval = options_.heartbeat_timeout / 4;
  uint64_t epoch = 0;
  std::vector<uint32_t> live;
  for (uint32_t node = 0; node < options_.num_nodes; ++node) live.push_back(node);
  std::map<uint32_t, uint64_t> generations;  // how many times each node had joined, as last heard
  bool failing = false;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shut_down_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopped), interval)) return;
    }
    // Bounded, so a cut link to the coordinator never holds this thread past the next heartbeat.
    absl::StatusOr<LiveSet> set = cluster_->Heartbeat(absl::Now() + interval);
    if (!set.ok()) {
      if (absl::IsUnimplemented(set.status())) {
        common::Log("the coordinator takes no heartbeats (--heartbeat_timeout=0 on node 0): the group is fixed");
        return;
      }
      if (!failing) common::Log("cannot heartbeat to the coordinator: %s", set.status().message());
      failing = true;
      continue;
    }
    if (failing) common::Log("heartbeats reach the coordinator again");
    failing = false;
    if (set->epoch != epoch) {
      std::vector<uint32_t> left, returned;
      std::set_difference(live.begin(), live.end(), set->live.begin(), set->live.end(), std::back_inserter(left));
      std::set_difference(set->live.begin(), set->live.end(), live.begin(), live.end(), std::back_inserter(returned));
      if (!left.empty()) {
        common::Log("%s stopped heartbeating to the coordinator (--heartbeat_timeout=%g s); live: %s",
                    set->DescribeSilent(left), absl::ToDoubleSeconds(options_.heartbeat_timeout),
                    absl::StrJoin(set->live, ", "));
        metrics_->OnMembershipChange("left", static_cast<uint32_t>(left.size()));
      }
      std::vector<uint32_t> restarted;
      for (uint32_t node : set->live) {
        const uint64_t before = generations.count(node) ? generations[node] : 0;
        if (before > 0 && set->Generation(node) > before) restarted.push_back(node);
      }
      if (!restarted.empty()) {
        common::Log("node%s %s restarted (joined the cluster again); live: %s", restarted.size() == 1 ? "" : "s",
                    absl::StrJoin(restarted, ", "), absl::StrJoin(set->live, ", "));
        metrics_->OnMembershipChange("restarted", static_cast<uint32_t>(restarted.size()));
      }
      if (!returned.empty()) {
        common::Log("node%s %s heartbeat%s again; live: %s", returned.size() == 1 ? "" : "s",
                    absl::StrJoin(returned, ", "), returned.size() == 1 ? "s" : "", absl::StrJoin(set->live, ", "));
        metrics_->OnMembershipChange("returned", static_cast<uint32_t>(returned.size()));
      }
      epoch = set->epoch;
      live = set->live;
      for (uint32_t node : set->live) generations[node] = set->Generation(node);
    }
    std::vector<std::shared_ptr<Job>> jobs;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, job] : jobs_) jobs.push_back(job);
    }
    for (const std::shared_ptr<Job>& job : jobs) job->OnMembership(*set);
  }
}

absl::Status Daemon::OpenDevice() {
#ifdef DQ_HAVE_NCCL
  DQ_RETURN_IF_ERROR(CheckCudaDevice(options_.cuda_device));
  DQ_ASSIGN_OR_RETURN(std::unique_ptr<ipc::DeviceMemory> memory, CreateCudaDeviceMemory(options_.cuda_device));
  device_uuid_ = memory->uuid();
  ipc::DeviceBufferRegistry::Options limits;
  limits.max_total_bytes = options_.max_device_bytes;
  limits.max_total_buffers = options_.max_buffers;
  buffers_->SetDevice(std::make_unique<ipc::DeviceBufferRegistry>(std::move(memory), limits));
#endif
  return absl::OkStatus();
}

void Daemon::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (coordinator_watch_.joinable()) coordinator_watch_.join();
  if (membership_watch_.joinable()) membership_watch_.join();
  // No controller decision is published while the jobs go away.
  if (error_budget_) error_budget_->Stop();
  // No scrape may read the jobs or the shared memory while they go away.
  metrics_->StopServing();
  metrics_->SetGaugeSource(nullptr);
  if (operator_server_) operator_server_->GetHealthCheckService()->SetServingStatus(false);
  // No more submissions through the rings (those not taken yet fail); what the jobs still run
  // answers into them.
  rings_->CloseAll(absl::UnavailableError("dynamiqd is shutting down"));
  // Fail in-flight collectives first so blocked handlers return, then stop the servers.
  std::map<std::string, std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    jobs.swap(jobs_);
  }
  for (auto& [id, job] : jobs) job->Stop();  // fails in-flight work; handlers return
  jobs.clear();
  const auto deadline = absl::ToChronoTime(absl::Now() + grace);
  worker_listener_.reset();  // stops accepting workers, unlinks the socket
  if (worker_server_) worker_server_->Shutdown(deadline);
  if (operator_server_) operator_server_->Shutdown(deadline);
  process_watcher_.reset();  // no more exit callbacks
  buffers_.reset();          // unmaps and unlinks every shared-memory buffer, frees every device buffer
}

void Daemon::Wait() {
  if (worker_server_) worker_server_->Wait();
  if (operator_server_) operator_server_->Wait();
}

std::string Daemon::listen_address() const {
  absl::MutexLock lock(&mu_);
  return listen_address_;
}

std::string Daemon::metrics_address() const {
  absl::MutexLock lock(&mu_);
  return metrics_address_;
}

double Daemon::error_sample_rate() const {
  absl::MutexLock lock(&mu_);
  return error_sample_rate_;
}

void Daemon::RecordRejected(const absl::Status& status, absl::string_view who) { reject_log_->Record(status, who); }

std::vector<uint32_t> Daemon::LiveNodes() const {
  absl::MutexLock lock(&mu_);
  if (cluster_ == nullptr) return {};
  const LiveSet live = cluster_->live();
  if (live.epoch == 0) return {};
  return live.live;
}

std::vector<std::string> Daemon::members() const {
  absl::MutexLock lock(&mu_);
  if (cluster_ != nullptr) return cluster_->members();
  // The cluster has not formed: only this node's own place is known (the others by rank are "").
  std::vector<std::string> members(options_.num_nodes);
  if (options_.node_rank < members.size()) members[options_.node_rank] = listen_address_;
  return members;
}

absl::StatusOr<std::shared_ptr<Job>> Daemon::CreateJob(const std::string& job_id, uint64_t incarnation,
                                                       uint32_t local_world_size,
                                                       std::optional<uint64_t> rejoin_after_view) {
  Job::Options o;
  o.rejoin_after_view = rejoin_after_view;
  o.live_at_start = cluster_->live();
  if (o.live_at_start.epoch == 0 && options_.num_nodes > 1 && options_.heartbeat_timeout > absl::ZeroDuration()) {
    // No heartbeat answered yet (the daemon just started): ask now, so the job knows how many times
    // each node had joined before it (a restart after this is one).
    absl::StatusOr<LiveSet> now = cluster_->Heartbeat(absl::Now() + options_.heartbeat_timeout / 4);
    if (now.ok()) o.live_at_start = *std::move(now);
  }
  o.id = job_id;
  o.incarnation = incarnation;
  o.local_world_size = local_world_size;
  o.num_nodes = options_.num_nodes;
  o.node_rank = options_.node_rank;
  o.config = options_.default_config;
  o.timeout = options_.timeout;
  o.observer = observers_.get();
  o.error_sample_rate = error_sample_rate();
  o.arc_topk_error_feedback = options_.arc_topk_error_feedback;
  o.arc_topk_momentum = options_.arc_topk_momentum;
  o.lossy_send_bytes_per_second = options_.udp_send_mbps * 1e6 / 8;
  o.error_feedback_bytes = options_.error_feedback_mib << 20;
  o.step_budget = options_.step_budget;
  o.codec_pool = codec_pool_;
  // Engine messages between nodes carry HMAC tags under the job's key (engine/step_auth.h).
  if (!security_.cluster_secret.empty()) {
    o.authenticator = engine::StepAuthenticator::ForJob(security_.cluster_secret, job_id);
  }
#ifdef DQ_HAVE_NCCL
  if (options_.device == DeviceKind::kCuda) {
    absl::StatusOr<std::unique_ptr<DataPath>> device = CreateCudaDataPath(options_.cuda_device);
    if (!device.ok()) {
      return common::Annotate(device.status(), absl::StrCat("job ", job_id, ": cannot set up its device collective"));
    }
    o.data_path = *std::move(device);
  }
#endif
  JobTransportSettings transport;
  transport.node_rank = options_.node_rank;
  transport.num_nodes = options_.num_nodes;
  transport.device = options_.device;
  transport.nccl = UsesNccl(options_);
  transport.tcp = UsesTcp(options_);
  transport.datagrams = UsesDatagrams(options_);
  transport.cuda_device = options_.cuda_device;
  transport.timeout = options_.timeout;
  transport.peer_host = peer_host_;
  transport.metrics = metrics_.get();
  // The TCP transport's hellos prove the job's key both ways (engine/tcp_hello.h).
  if (!security_.cluster_secret.empty()) {
    transport.key = engine::StepAuthenticator::KeyForJob(security_.cluster_secret, job_id);
  }
  o.coordinator = std::make_shared<ClusterJobCoordinator>(*cluster_, job_id, incarnation, std::move(transport));
  return std::make_shared<Job>(std::move(o));
}

absl::StatusOr<std::shared_ptr<Job>> Daemon::FindJob(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' on this node"));
  return it->second;
}

absl::StatusOr<GroupView> Daemon::ChangeView(const std::string& job_id, std::vector<uint32_t> members) {
  DQ_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  DQ_ASSIGN_OR_RETURN(GroupView view, job->ChangeView(std::move(members)));
  common::Log("job %s: %s claimed", job_id, view.ToString());
  return view;
}

absl::StatusOr<PublishedChange> Daemon::SetCompression(const std::string& job_id, const CompressionChange& change,
                                                       std::optional<uint64_t> expected_epoch) {
  absl::StatusOr<std::shared_ptr<Job>> found = FindJob(job_id);
  if (!found.ok()) {
    // Settings that could never apply are the better answer (INVALID_ARGUMENT before NOT_FOUND).
    DQ_RETURN_IF_ERROR(change(options_.default_config).status());
    return common::Restate(found.status(),
                           absl::StrCat(found.status().message(),
                                        ": a job exists only while its workers are registered (from its first "
                                        "worker's Register to its last one's leaving), and takes dynamiqd's --codec, "
                                        "--bits and --topology when it starts"));
  }
  std::shared_ptr<Job> job = *std::move(found);
  absl::MutexLock lock(&config_mu_);
  auto checked = [&](const JobConfig& newest) -> absl::StatusOr<JobConfig> {
    DQ_ASSIGN_OR_RETURN(JobConfig config, change(newest));
    // A GPU node runs only what its device all-reduce implements.
    DQ_RETURN_IF_ERROR(CheckConfigForDevice(config, options_.device));
    DQ_RETURN_IF_ERROR(CheckConfigForTransport(config, options_));
    DQ_RETURN_IF_ERROR(CheckErrorBudgetSampled(config, options_.num_nodes, error_sample_rate()));
    return config;
  };
  // Nodes run collectives in lockstep: another node can be at most one collective ahead of this
  // one, so none can have started (next + 2) before the configuration is visible; the job's side
  // lane tells every node to ask for it there (Job::ReserveConfigBoundary).
  return cluster_->PublishConfig(
      job_id, job->incarnation(), job->initial_config(), checked, [&job] { return job->ReserveConfigBoundary(); },
      expected_epoch);
}

std::map<std::string, Job::Status> Daemon::JobStatuses() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, Job::Status> out;
  for (const auto& [id, job] : jobs_) out[id] = job->GetStatus();
  return out;
}

std::vector<std::string> Daemon::RecordedJobs() const {
  const std::vector<std::string> retired = retired_.Jobs();
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  for (const std::string& id : retired) {
    if (!jobs_.count(id)) ids.push_back(id);
  }
  return ids;
}

absl::StatusOr<std::vector<CollectiveRecord>> Daemon::FlightRecorder(const std::string& job_id, size_t limit) const {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(job_id);
  if (job.ok()) return (*job)->FlightRecorder(limit);
  if (std::optional<std::vector<CollectiveRecord>> kept = retired_.Find(job_id, limit)) return *std::move(kept);
  return job.status();
}

}  // namespace dynamiq::server
