#include "server/daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "engine/gloo_transport.h"
#include "server/control_service.h"
#include "server/grpc_store.h"
#include "server/rendezvous_service.h"
#include "server/worker_service.h"

namespace dynamiq::server {
namespace {

// "job/<id>/config/<epoch>" holds "<codec>|<bits>|<topology>|<min>|<allocator>|<apply_at>".
std::string EncodeConfig(const JobConfig& c, uint64_t apply_at) {
  return absl::StrCat(kernels::CodecName(c.codec.id), "|", c.codec.bits, "|", engine::TopologyName(c.topology), "|",
                      c.min_compress_elements, "|",
                      c.codec.allocator == kernels::BitAllocator::kMeasured ? "measured" : "paper", "|", apply_at);
}

absl::StatusOr<std::pair<JobConfig, uint64_t>> DecodeConfig(const std::string& s) {
  std::vector<std::string> f = absl::StrSplit(s, '|');
  double bits;
  uint64_t min, apply_at;
  if (f.size() != 6 || !absl::SimpleAtod(f[1], &bits) || !absl::SimpleAtoi(f[3], &min) ||
      !absl::SimpleAtoi(f[5], &apply_at)) {
    return absl::DataLossError(absl::StrCat("malformed published configuration '", s, "'"));
  }
  DQ_ASSIGN_OR_RETURN(JobConfig c, MakeJobConfig(f[0], bits, f[2], min, f[4]));
  return std::make_pair(c, apply_at);
}

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

Daemon::Daemon(DaemonOptions options) : options_(std::move(options)) {
  ShmRegistry::Options shm;
  shm.max_total_bytes = options_.max_shm_bytes;
  registry_ = std::make_unique<ShmRegistry>(shm);
}

Daemon::~Daemon() { Shutdown(absl::Seconds(1)); }

absl::Status Daemon::Start() {
  if (options_.num_nodes == 0 || options_.node_rank >= options_.num_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--node_rank ", options_.node_rank, " is not in a cluster of ", options_.num_nodes, " nodes"));
  }
  const bool coordinator_here = options_.coordinator.empty() && options_.node_rank == 0;
  if (options_.coordinator.empty() && options_.num_nodes > 1 && !coordinator_here) {
    return absl::InvalidArgumentError("--coordinator is required on nodes other than node 0");
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  // Operator (and coordinator) server on TCP.
  control_service_ = std::make_unique<ControlService>(*this);
  grpc::ServerBuilder op;
  int port = 0;
  op.AddListeningPort(options_.listen, grpc::InsecureServerCredentials(), &port);
  op.RegisterService(control_service_.get());
  if (coordinator_here) {
    rendezvous_ = std::make_unique<RendezvousService>();
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
  operator_server_->GetHealthCheckService()->SetServingStatus("dynamiq.v1.Control", true);

  // The coordinator's store: in-process for a single node, else over gRPC.
  if (options_.num_nodes == 1) {
    store_ = std::make_unique<engine::InMemoryStore>();
  } else {
    const std::string me = listen_address();
    auto grpc_store = std::make_unique<GrpcStore>(coordinator_here ? me : options_.coordinator);
    DQ_ASSIGN_OR_RETURN(std::vector<std::string> members,
                        grpc_store->Join(options_.node_rank, options_.num_nodes, me, options_.timeout));
    absl::MutexLock lock(&mu_);
    members_ = std::move(members);
    store_ = std::move(grpc_store);
  }

  // Worker server on a Unix socket only the owner can reach.
  const std::string dir = options_.worker_socket.substr(0, options_.worker_socket.rfind('/'));
  if (!dir.empty() && mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::UnavailableError(absl::StrCat("cannot create ", dir, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (lstat(options_.worker_socket.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(options_.worker_socket, " exists and is not a socket; refusing to replace it"));
    }
    unlink(options_.worker_socket.c_str());  // a stale socket from a previous run
  }
  worker_service_ = std::make_unique<WorkerService>(*this);
  grpc::ServerBuilder wb;
  wb.AddListeningPort("unix:" + options_.worker_socket, grpc::InsecureServerCredentials());
  wb.RegisterService(worker_service_.get());
  worker_server_ = wb.BuildAndStart();
  if (!worker_server_) return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.worker_socket));
  if (chmod(options_.worker_socket.c_str(), 0600) != 0) {
    return absl::UnavailableError(absl::StrCat("chmod 0600 ", options_.worker_socket, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void Daemon::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (operator_server_) operator_server_->GetHealthCheckService()->SetServingStatus(false);
  // Fail in-flight collectives first so blocked handlers return, then stop the servers.
  std::map<std::string, std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    jobs.swap(jobs_);
  }
  for (auto& [id, job] : jobs) job->Stop();  // fails in-flight work; handlers return
  jobs.clear();
  const auto deadline = absl::ToChronoTime(absl::Now() + grace);
  if (worker_server_) worker_server_->Shutdown(deadline);
  if (operator_server_) operator_server_->Shutdown(deadline);
  registry_.reset();  // unmaps and unlinks every shared-memory buffer
  if (!options_.worker_socket.empty()) unlink(options_.worker_socket.c_str());
}

void Daemon::Wait() {
  if (worker_server_) worker_server_->Wait();
  if (operator_server_) operator_server_->Wait();
}

std::string Daemon::listen_address() const {
  absl::MutexLock lock(&mu_);
  return listen_address_;
}

std::vector<std::string> Daemon::members() const {
  absl::MutexLock lock(&mu_);
  return members_.empty() ? std::vector<std::string>{listen_address_} : members_;
}

Job* Daemon::GetOrCreateJob(const std::string& job_id, uint32_t local_world_size) {
  auto it = jobs_.find(job_id);
  if (it != jobs_.end()) return it->second.get();
  Job::Options o;
  o.id = job_id;
  o.local_world_size = local_world_size;
  o.num_nodes = options_.num_nodes;
  o.config = options_.default_config;
  o.timeout = options_.timeout;
  o.connect = [this, job_id](uint64_t generation) -> absl::StatusOr<std::unique_ptr<engine::Transport>> {
    engine::PrefixStore scoped(absl::StrCat("job/", job_id, "/gen", generation), *store_);
    engine::GlooTransportOptions t;
    t.hostname = peer_host_;
    t.timeout = options_.timeout;
    return engine::ConnectGlooTransport(scoped, static_cast<int>(options_.node_rank),
                                        static_cast<int>(options_.num_nodes), t);
  };
  o.poll_config = [this, job_id](uint64_t sequence, uint64_t* epoch, JobConfig* config) {
    return PollConfig(job_id, sequence, epoch, config);
  };
  auto job = std::make_shared<Job>(std::move(o));
  Job* raw = job.get();
  jobs_[job_id] = std::move(job);
  return raw;
}

absl::StatusOr<std::shared_ptr<Job>> Daemon::FindJob(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' on this node"));
  return it->second;
}

absl::StatusOr<Daemon::Registration> Daemon::Register(const std::string& job_id, uint32_t local_rank,
                                                      uint32_t local_world_size) {
  if (local_world_size == 0 || local_world_size > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("local world size must be 1..1024, got ", local_world_size));
  }
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("dynamiqd is shutting down");
  Job* job = GetOrCreateJob(job_id, local_world_size);
  const uint64_t id = next_worker_id_++;
  DQ_RETURN_IF_ERROR(job->AddWorker(id, local_rank, local_world_size));
  worker_jobs_[id] = job_id;
  Job::Status s = job->GetStatus();
  return Registration{id, s.config_epoch, s.config};
}

absl::StatusOr<ShmBufferInfo> Daemon::Allocate(uint64_t worker_id, size_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    if (!worker_jobs_.count(worker_id)) {
      return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id, " is not registered"));
    }
  }
  return registry_->Allocate(worker_id, bytes);
}

absl::Status Daemon::Mapped(uint64_t worker_id, uint64_t buffer_id) { return registry_->Unlink(worker_id, buffer_id); }

absl::Status Daemon::Release(uint64_t worker_id, uint64_t buffer_id) {
  std::string job_id;
  {
    absl::MutexLock lock(&mu_);
    auto it = worker_jobs_.find(worker_id);
    if (it != worker_jobs_.end()) job_id = it->second;
  }
  if (!job_id.empty()) {
    auto job = FindJob(job_id);
    if (job.ok() && (*job)->BufferInUse(worker_id, buffer_id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("buffer ", buffer_id, " is used by an all-reduce that has not completed"));
    }
  }
  return registry_->Release(worker_id, buffer_id);
}

absl::Status Daemon::Unregister(uint64_t worker_id) {
  std::string job_id;
  {
    absl::MutexLock lock(&mu_);
    auto it = worker_jobs_.find(worker_id);
    if (it == worker_jobs_.end()) return absl::NotFoundError(absl::StrCat("worker ", worker_id, " is not registered"));
    job_id = it->second;
    worker_jobs_.erase(it);
  }
  DQ_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  job->RemoveWorker(worker_id);
  registry_->ReleaseWorker(worker_id);
  return absl::OkStatus();
}

absl::StatusOr<Job::Result> Daemon::AllReduce(const AllReduceCall& call) {
  std::string job_id;
  {
    absl::MutexLock lock(&mu_);
    auto it = worker_jobs_.find(call.worker_id);
    if (it == worker_jobs_.end()) {
      return absl::FailedPreconditionError(absl::StrCat("worker ", call.worker_id, " is not registered"));
    }
    job_id = it->second;
  }
  if (call.num_elements == 0 || call.num_elements > (uint64_t{1} << 34)) {
    return absl::InvalidArgumentError(absl::StrCat("element count ", call.num_elements, " is out of range"));
  }
  if (call.tensor_name.size() > 1024) return absl::InvalidArgumentError("tensor name longer than 1024 bytes");
  const size_t bytes = call.num_elements * kernels::DTypeSize(call.dtype);
  DQ_ASSIGN_OR_RETURN(absl::Span<uint8_t> region,
                      registry_->Get(call.worker_id, call.buffer_id, call.offset_bytes, bytes));
  if (reinterpret_cast<uintptr_t>(region.data()) % kernels::DTypeSize(call.dtype) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset ", call.offset_bytes, " is not aligned to ", kernels::DTypeName(call.dtype)));
  }
  DQ_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  Job::Request r;
  r.worker_id = call.worker_id;
  r.buffer_id = call.buffer_id;
  r.tensor_name = call.tensor_name;
  r.num_elements = call.num_elements;
  r.dtype = call.dtype;
  r.average = call.average;
  r.region = region;
  r.submission = call.submission;
  return job->Submit(r);
}

absl::StatusOr<uint64_t> Daemon::SetCompression(const std::string& job_id, const JobConfig& config,
                                                uint64_t expected_epoch) {
  DQ_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  absl::MutexLock lock(&config_mu_);
  // The newest epoch any node published for this job (they may have changed it elsewhere).
  uint64_t current = std::max(published_epoch_[job_id], job->GetStatus().config_epoch);
  auto latest = store_->Get(absl::StrCat("job/", job_id, "/latest_epoch"), absl::ZeroDuration());
  uint64_t stored = 0;
  if (latest.ok() && absl::SimpleAtoi(*latest, &stored)) current = std::max(current, stored);
  if (expected_epoch != 0 && expected_epoch != current) {
    return absl::AbortedError(absl::StrCat("job ", job_id, " is at config epoch ", current, ", not ", expected_epoch));
  }
  const uint64_t epoch = current + 1;
  // Nodes run collectives in lockstep: another node can be at most one collective ahead of this
  // one, so none can have started (next + 2) before this key is visible.
  const uint64_t apply_at = job->NextSequence() + 2;
  DQ_RETURN_IF_ERROR(store_->Set(absl::StrCat("job/", job_id, "/config/", epoch), EncodeConfig(config, apply_at)));
  DQ_RETURN_IF_ERROR(store_->Set(absl::StrCat("job/", job_id, "/latest_epoch"), absl::StrCat(epoch)));
  published_epoch_[job_id] = epoch;
  return epoch;
}

absl::StatusOr<bool> Daemon::PollConfig(const std::string& job_id, uint64_t sequence, uint64_t* epoch,
                                        JobConfig* config) {
  auto latest = store_->Get(absl::StrCat("job/", job_id, "/latest_epoch"), absl::ZeroDuration());
  uint64_t newest = 0;
  if (!latest.ok() || !absl::SimpleAtoi(*latest, &newest) || newest <= *epoch) return false;
  // Apply the newest epoch whose boundary has been reached.
  for (uint64_t e = newest; e > *epoch; --e) {
    auto value = store_->Get(absl::StrCat("job/", job_id, "/config/", e), absl::Seconds(5));
    if (!value.ok()) return value.status();
    DQ_ASSIGN_OR_RETURN(auto decoded, DecodeConfig(*value));
    if (decoded.second <= sequence) {
      *epoch = e;
      *config = decoded.first;
      return true;
    }
  }
  return false;
}

std::map<std::string, Job::Status> Daemon::JobStatuses() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, Job::Status> out;
  for (const auto& [id, job] : jobs_) out[id] = job->GetStatus();
  return out;
}

absl::StatusOr<std::vector<CollectiveRecord>> Daemon::FlightRecorder(const std::string& job_id, size_t limit) const {
  DQ_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  return job->FlightRecorder(limit);
}

}  // namespace dynamiq::server
