// The worker-facing half of Daemon (server/daemon.h): registration, buffers, all-reduce calls and
// what happens when a worker leaves. The node's start-up, shutdown, jobs and operator calls are in
// server/daemon.cc.
#include "server/daemon.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "dynamiq/v1/common.pb.h"
#include "ipc/process_watcher.h"
#include "ipc/worker_listener.h"
#include "server/cluster.h"
#include "server/error_budget_service.h"
#include "server/metrics.h"
#include "server/request_names.h"

namespace dynamiq::server {

absl::StatusOr<Daemon::Registration> Daemon::AddWorker(Job& job, const std::string& job_id, uint32_t local_rank,
                                                       uint32_t local_world_size,
                                                       const std::optional<ipc::PeerCredentials>& peer) {
  const uint64_t id = next_worker_id_++;
  DQ_RETURN_IF_ERROR(job.AddWorker(id, local_rank, local_world_size, peer.has_value() ? peer->pid : 0));
  worker_jobs_[id] = job_id;
  if (peer.has_value()) worker_pids_[id] = peer->pid;
  if (peer.has_value() && process_watcher_) {
    // A worker that dies without unregistering is removed at once (not at the collective timeout).
    const pid_t pid = peer->pid;
    auto watch = process_watcher_->Watch(pid, [this, id, pid, local_rank] {
      (void)RemoveWorker(id, absl::StrCat("local rank ", local_rank, " (worker ", id, ", pid ", pid, ") exited"));
    });
    if (watch.ok()) worker_watches_[id] = *watch;
  }
  Job::Status s = job.GetStatus();
  return Registration{id, s.config_epoch, s.config};
}

absl::StatusOr<Daemon::Registration> Daemon::Register(const std::string& job_id, uint32_t local_rank,
                                                      uint32_t local_world_size,
                                                      std::optional<ipc::PeerCredentials> peer) {
  if (local_world_size == 0 || local_world_size > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("local world size must be 1..1024, got ", local_world_size));
  }
  // Checked here so that the first worker of a new job is always accepted: a job (and its
  // incarnation) is only created for a worker that joins it.
  if (local_rank >= local_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("local rank ", local_rank, " is not below the local world size ", local_world_size));
  }
  auto live = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<std::optional<Registration>> {
    if (shut_down_) return absl::UnavailableError("dynamiqd is shutting down");
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return std::optional<Registration>();
    DQ_ASSIGN_OR_RETURN(Registration r, AddWorker(*it->second, job_id, local_rank, local_world_size, peer));
    return std::optional<Registration>(std::move(r));
  };
  {
    absl::MutexLock lock(&mu_);
    DQ_ASSIGN_OR_RETURN(std::optional<Registration> r, live());
    if (r.has_value()) return *r;
  }
  // A new job (or a new incarnation of a retired one): one creation at a time, since it claims the
  // incarnation from the coordinator's store, which is not done under mu_.
  absl::MutexLock create(&create_mu_);
  {
    absl::MutexLock lock(&mu_);
    DQ_ASSIGN_OR_RETURN(std::optional<Registration> r, live());  // created meanwhile
    if (r.has_value()) return *r;
    // Every job has its reducer thread and transport: a bound keeps a runaway launcher (or a
    // hostile worker) from exhausting the node's threads. Creations are serialized by create_mu_.
    DQ_RETURN_IF_ERROR(CheckAnotherJob(options_, jobs_.size(), QuoteName(job_id)));
  }
  // A node whose previous dynamiqd died running the job rejoins the members' incarnation, where
  // they went on without it (server/membership.h); otherwise the job starts its next incarnation.
  std::optional<Cluster::Rejoin> rejoin;
  if (options_.num_nodes > 1 && options_.heartbeat_timeout > absl::ZeroDuration()) {
    // While the members have not yet noticed the restart, wait for them only if they may go on
    // without this node (--min_nodes below the cluster's size).
    const bool may_shrink = options_.min_nodes > 0 && options_.min_nodes < options_.num_nodes;
    DQ_ASSIGN_OR_RETURN(rejoin, cluster_->RejoinableIncarnation(
                                    job_id, may_shrink ? 2 * options_.heartbeat_timeout : absl::ZeroDuration()));
  }
  uint64_t incarnation = 0;
  if (rejoin.has_value()) {
    DQ_RETURN_IF_ERROR(cluster_->RejoinIncarnation(job_id, rejoin->incarnation));
    incarnation = rejoin->incarnation;
  } else {
    DQ_ASSIGN_OR_RETURN(incarnation, cluster_->ClaimIncarnation(job_id));
  }
  absl::StatusOr<std::shared_ptr<Job>> created =
      CreateJob(job_id, incarnation, local_world_size,
                rejoin.has_value() ? std::optional<uint64_t>(rejoin->view_epoch) : std::nullopt);
  if (!created.ok()) {
    cluster_->RetireJob(job_id, incarnation);  // the claim's keys (server/cluster.h: key lifecycle)
    return created.status();
  }
  std::shared_ptr<Job> job = *std::move(created);
  absl::StatusOr<Registration> registered;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) {
      registered = absl::UnavailableError("dynamiqd is shutting down");
    } else {
      registered = AddWorker(*job, job_id, local_rank, local_world_size, peer);
      if (registered.ok()) jobs_[job_id] = job;
    }
  }
  if (!registered.ok()) {
    job->Close();  // a job without workers: not kept (the incarnation it claimed stays used)
    cluster_->RetireJob(job_id, incarnation);
    return registered.status();
  }
  if (rejoin.has_value()) {
    common::Log("job %s: rejoining incarnation %d, where the members went on in view %d without this node", job_id,
                incarnation, rejoin->view_epoch);
  } else {
    common::Log("job %s: incarnation %llu started", job_id.c_str(), static_cast<unsigned long long>(incarnation));
  }
  return registered;
}

absl::Status Daemon::CheckCaller(uint64_t worker_id, const std::optional<ipc::PeerCredentials>& caller) const {
  if (!caller.has_value()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  auto it = worker_pids_.find(worker_id);
  if (it == worker_pids_.end() || it->second == caller->pid) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("worker ", worker_id, " was registered by process ", it->second,
                   ", and this call comes from process ", caller->pid,
                   ": a worker id is good only in the process that registered it (a worker left over from an "
                   "earlier dynamiqd on this socket, whose ids this one hands out again?)"));
}

absl::StatusOr<std::string> Daemon::JobOfWorker(uint64_t worker_id) const {
  auto it = worker_jobs_.find(worker_id);
  if (it == worker_jobs_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id, " is not registered"));
  }
  return it->second;
}

absl::Status Daemon::CheckRegistered(uint64_t worker_id) const {
  absl::MutexLock lock(&mu_);
  return JobOfWorker(worker_id).status();
}

absl::StatusOr<ipc::ShmBufferInfo> Daemon::Allocate(uint64_t worker_id, size_t bytes) {
  DQ_RETURN_IF_ERROR(CheckRegistered(worker_id));
  return buffers_->Allocate(worker_id, bytes);
}

absl::StatusOr<ipc::DeviceBufferInfo> Daemon::AllocateDevice(uint64_t worker_id, size_t bytes) {
  DQ_RETURN_IF_ERROR(CheckRegistered(worker_id));
  return buffers_->AllocateDevice(worker_id, bytes);
}

absl::Status Daemon::Mapped(uint64_t worker_id, uint64_t buffer_id) { return buffers_->Mapped(worker_id, buffer_id); }

// The registries refuse a buffer that an all-reduce request holds (BufferUse).
absl::Status Daemon::Release(uint64_t worker_id, uint64_t buffer_id) { return buffers_->Release(worker_id, buffer_id); }

absl::Status Daemon::Unregister(uint64_t worker_id) {
  return RemoveWorker(worker_id, absl::StrCat("worker ", worker_id, " unregistered"));
}

absl::Status Daemon::RemoveWorker(uint64_t worker_id, const std::string& reason) {
  std::shared_ptr<Job> job;
  bool last = false;  // the job's last local worker: retire the job
  uint64_t watch = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = worker_jobs_.find(worker_id);
    if (it == worker_jobs_.end()) return absl::NotFoundError(absl::StrCat("worker ", worker_id, " is not registered"));
    const std::string job_id = it->second;
    worker_jobs_.erase(it);
    worker_pids_.erase(worker_id);
    auto w = worker_watches_.find(worker_id);
    if (w != worker_watches_.end()) {
      watch = w->second;
      worker_watches_.erase(w);
    }
    auto j = jobs_.find(job_id);
    if (j != jobs_.end()) {
      job = j->second;
      last = std::none_of(worker_jobs_.begin(), worker_jobs_.end(), [&](const auto& e) { return e.second == job_id; });
      // Taken out now, in the same critical section: a worker that registers from here on starts
      // the next incarnation instead of joining one that is going away.
      if (last) jobs_.erase(j);
    }
  }
  if (watch != 0 && process_watcher_) process_watcher_->Unwatch(watch);
  // No more submissions from the worker's ring; those it had pushed and the daemon not yet taken
  // fail with the reason (a worker that is still there then reads it).
  rings_->Close(worker_id, absl::FailedPreconditionError(reason));
  if (job == nullptr) return absl::UnavailableError("dynamiqd is shutting down");  // Shutdown stopped the jobs
  const std::string retired = absl::StrCat("job ", job->id(), " (incarnation ", job->incarnation(),
                                           ") is retired: its last local worker left (", reason, ")");
  // A collective still running needs every local worker, so it cannot succeed any more: abort it
  // (Stop) rather than wait for it, before the worker's buffers are released.
  if (last) job->Stop(retired);
  job->RemoveWorker(worker_id, reason);
  buffers_->ReleaseWorker(worker_id);
  if (last) RetireJob(std::move(job), retired);
  return absl::OkStatus();
}

void Daemon::RetireJob(std::shared_ptr<Job> job, const std::string& reason) {
  // Joins the reducer (Stop has made it return or abort its collective) and closes the transport.
  job->Close();
  // Nothing reports on this incarnation any more: drop its per-job state, its keys in the
  // coordinator's store among them (all of the job's once no node runs it). The metrics keep its
  // series for one more scrape; the controller (node 0) is started afresh for a next incarnation.
  cluster_->RetireJob(job->id(), job->incarnation());
  if (error_budget_) error_budget_->ForgetJob(job->id());
  metrics_->RetireJob(job->id());
  retired_.Keep(job->id(), job->FlightRecorder(0));
  common::Log("%s", reason.c_str());
}

std::optional<ipc::PeerCredentials> Daemon::WorkerPeer(const std::string& grpc_peer) const {
  return worker_listener_ ? worker_listener_->CredentialsOf(grpc_peer) : std::nullopt;
}

void Daemon::AllReduceAsync(const AllReduceCall& call, Job::Completion done) {
  std::shared_ptr<Job> job;
  absl::StatusOr<Job::Request> request = CheckAllReduce(call, &job);
  if (!request.ok()) {
    RefuseAllReduce(call, request.status(), std::move(done));
    return;
  }
  // The job completes every request it accepted before it closes (Job::Stop), so `done` never
  // outlives it.
  job->Enqueue(*std::move(request), std::move(done));
}

void Daemon::RefuseAllReduce(const AllReduceCall& call, const absl::Status& why, Job::Completion done) {
  RecordRejected(why, absl::StrCat("worker ", call.worker_id));
  std::shared_ptr<Job> job;
  if (call.submission.has_value()) {
    absl::MutexLock lock(&mu_);
    if (absl::StatusOr<std::string> id = JobOfWorker(call.worker_id); id.ok()) {
      auto j = jobs_.find(*id);
      if (j != jobs_.end()) job = j->second;
    }
  }
  if (job == nullptr) {
    done(why);
    return;
  }
  // Its place in the worker's numbering stays taken (Job::Request::refused).
  Job::Request placeholder;
  placeholder.worker_id = call.worker_id;
  placeholder.tensor_name = call.tensor_name;
  placeholder.submission = call.submission;
  placeholder.refused = why;
  job->Enqueue(std::move(placeholder), std::move(done));
}

absl::StatusOr<kernels::DType> Daemon::WireDType(int dtype) {
  switch (dtype) {
    case dynamiq::v1::DTYPE_FLOAT32:
      return kernels::DType::kFloat32;
    case dynamiq::v1::DTYPE_BFLOAT16:
      return kernels::DType::kBFloat16;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported dtype ", dtype));
  }
}

absl::StatusOr<Daemon::RingInfo> Daemon::OpenSubmissionRing(uint64_t worker_id, uint32_t slots) {
  if (slots == 0) slots = kDefaultRingSlots;
  if (slots > ipc::ring::kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("a submission ring has at most ", ipc::ring::kMaxSlots, " slots, not ", slots));
  }
  DQ_RETURN_IF_ERROR(CheckRegistered(worker_id));
  ipc::SubmissionRingServer::Options o;
  o.slots = slots;
  o.num_nodes = options_.num_nodes;
  o.name_hint = "ring";
  DQ_ASSIGN_OR_RETURN(std::unique_ptr<ipc::SubmissionRingServer> ring, ipc::SubmissionRingServer::Create(o));
  RingInfo info{ring->shm_name(), ring->bytes(), ring->slots()};
  // Started under mu_ with the registration checked again: a worker removed meanwhile has had its
  // ring closed already, and must not get one that nobody closes.
  absl::MutexLock lock(&mu_);
  DQ_RETURN_IF_ERROR(JobOfWorker(worker_id).status());
  DQ_RETURN_IF_ERROR(rings_->Start(worker_id, std::move(ring)));
  return info;
}

void Daemon::SubmitFromRing(uint64_t worker_id, const ipc::ring::RingRequest& request, WorkerRings::Reply reply) {
  AllReduceCall call;
  call.worker_id = worker_id;
  call.tensor_name = request.tensor_name;
  call.buffer_id = request.buffer_id;
  call.offset_bytes = request.offset_bytes;
  call.num_elements = request.num_elements;
  call.average = request.average;
  call.submission = request.submission;
  call.weight = request.weight;
  call.exact = request.exact;
  auto answer = [reply = std::move(reply)](absl::StatusOr<Job::Result> r) {
    ipc::ring::RingCompletion c;
    if (!r.ok()) {
      c.status = r.status();
      reply(c);
      return;
    }
    c.sequence = r->sequence;
    c.config_epoch = r->config_epoch;
    c.codec = std::string(kernels::CodecName(r->config.codec.id));
    c.bits = r->config.codec.bits;
    c.wire_bytes = r->wire_bytes;
    c.measured_vnmse = r->measured_vnmse;
    c.contributors = r->contributors;
    c.weight_sum = r->weight_sum;
    c.nodes = r->nodes;
    reply(c);
  };
  absl::StatusOr<kernels::DType> dtype = WireDType(static_cast<int>(request.dtype));
  if (!dtype.ok()) {
    RefuseAllReduce(call, dtype.status(), std::move(answer));
    return;
  }
  call.dtype = *dtype;
  AllReduceAsync(call, std::move(answer));
}

absl::StatusOr<Job::Request> Daemon::CheckAllReduce(const AllReduceCall& call, std::shared_ptr<Job>* job_out) {
  std::string job_id;
  {
    absl::MutexLock lock(&mu_);
    DQ_ASSIGN_OR_RETURN(job_id, JobOfWorker(call.worker_id));
  }
  if (call.num_elements == 0 || call.num_elements > (uint64_t{1} << 34)) {
    return absl::InvalidArgumentError(absl::StrCat("element count ", call.num_elements, " is out of range"));
  }
  DQ_RETURN_IF_ERROR(CheckRequestName("tensor name", call.tensor_name, kMaxTensorNameBytes, /*allow_empty=*/true));
  const size_t bytes = call.num_elements * kernels::DTypeSize(call.dtype);
  const bool device_memory = ipc::IsDeviceBufferId(call.buffer_id);
  // Taken before the memory is touched and held until the request is done: Release refuses the
  // buffer meanwhile, and a worker that goes away leaves it mapped until then.
  DQ_ASSIGN_OR_RETURN(ipc::BufferUse use, buffers_->Use(call.worker_id, call.buffer_id, call.offset_bytes, bytes));
  if (reinterpret_cast<uintptr_t>(use.region.data()) % kernels::DTypeSize(call.dtype) != 0) {
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
  r.region = use.region;
  r.buffer_use = std::move(use.hold);
  r.device_memory = device_memory;
  r.submission = call.submission;
  r.weight = call.weight;
  r.exact = call.exact;
  *job_out = std::move(job);
  return r;
}

}  // namespace dynamiq::server
