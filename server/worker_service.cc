#include "server/worker_service.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/request_names.h"

namespace dynamiq::server {
namespace {

// How a log line names the worker on the other end of `context`: its pid and uid when the daemon
// accepted its connection itself (the worker socket), else gRPC's peer name.
std::string DescribeWorkerPeer(const Daemon& daemon, const grpc::ServerContextBase& context) {
  const std::string peer = context.peer();
  if (std::optional<ipc::PeerCredentials> c = daemon.WorkerPeer(peer)) {
    return absl::StrCat("worker pid ", c->pid, " uid ", c->uid, " (", peer, ")");
  }
  return absl::StrCat("worker ", peer);
}

// Every error a handler returns (but a collective's own failure) is a refused request: counted and
// logged (rate-limited) with the worker's process.
grpc::Status Refuse(Daemon& daemon, const grpc::ServerContextBase* context, const absl::Status& status) {
  if (!status.ok()) daemon.RecordRejected(status, DescribeWorkerPeer(daemon, *context));
  return common::ToGrpcStatus(status);
}

}  // namespace

absl::StatusOr<uint64_t> WorkerService::Caller(const grpc::ServerContextBase& context, absl::string_view worker_id) {
  DQ_ASSIGN_OR_RETURN(const uint64_t worker, ParseWorkerId(worker_id));
  DQ_RETURN_IF_ERROR(daemon_.CheckCaller(worker, daemon_.WorkerPeer(context.peer())));
  return worker;
}

grpc::Status WorkerService::Register(grpc::ServerContext* context, const dynamiq::v1::RegisterRequest* request,
                                     dynamiq::v1::RegisterResponse* response) {
  if (absl::Status bad = CheckRequestName("job id", request->job_id(), kMaxJobIdBytes); !bad.ok()) {
    return Refuse(daemon_, context, bad);
  }
  auto r = daemon_.Register(request->job_id(), request->local_rank(), request->local_world_size(),
                            daemon_.WorkerPeer(context->peer()));
  if (!r.ok()) return Refuse(daemon_, context, r.status());
  response->set_worker_id(absl::StrCat(r->worker_id));
  response->set_node_rank(daemon_.options().node_rank);
  response->set_num_nodes(daemon_.options().num_nodes);
  response->set_config_epoch(r->config_epoch);
  ToProto(r->config, response->mutable_config());
  if (daemon_.options().device == DeviceKind::kCuda) {
    response->set_device(dynamiq::v1::DEVICE_KIND_CUDA);
    response->set_cuda_device(daemon_.options().cuda_device);
    response->set_cuda_device_uuid(daemon_.device_uuid());
  } else {
    response->set_device(dynamiq::v1::DEVICE_KIND_CPU);
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::AllocateBuffer(grpc::ServerContext* context,
                                           const dynamiq::v1::AllocateBufferRequest* request,
                                           dynamiq::v1::AllocateBufferResponse* response) {
  auto worker = Caller(*context, request->worker_id());
  if (!worker.ok()) return Refuse(daemon_, context, worker.status());
  switch (request->memory_kind()) {
    case dynamiq::v1::MEMORY_KIND_HOST: {
      auto info = daemon_.Allocate(*worker, request->bytes());
      if (!info.ok()) return Refuse(daemon_, context, info.status());
      response->set_buffer_id(info->buffer_id);
      response->set_shm_name(info->shm_name);
      response->set_bytes(info->size);
      response->set_memory_kind(dynamiq::v1::MEMORY_KIND_HOST);
      return grpc::Status::OK;
    }
    case dynamiq::v1::MEMORY_KIND_CUDA_DEVICE: {
      auto info = daemon_.AllocateDevice(*worker, request->bytes());
      if (!info.ok()) return Refuse(daemon_, context, info.status());
      response->set_buffer_id(info->buffer_id);
      response->set_bytes(info->size);
      response->set_memory_kind(dynamiq::v1::MEMORY_KIND_CUDA_DEVICE);
      response->set_cuda_ipc_handle(info->ipc_handle);
      response->set_cuda_device(info->device);
      response->set_cuda_device_uuid(info->device_uuid);
      return grpc::Status::OK;
    }
    default:
      return Refuse(
          daemon_, context,
          absl::InvalidArgumentError(absl::StrCat("unknown memory kind ", static_cast<int>(request->memory_kind()))));
  }
}

grpc::Status WorkerService::Mapped(grpc::ServerContext* context, const dynamiq::v1::MappedRequest* request,
                                   dynamiq::v1::MappedResponse*) {
  auto worker = Caller(*context, request->worker_id());
  if (!worker.ok()) return Refuse(daemon_, context, worker.status());
  return Refuse(daemon_, context, daemon_.Mapped(*worker, request->buffer_id()));
}

grpc::Status WorkerService::ReleaseBuffer(grpc::ServerContext* context,
                                          const dynamiq::v1::ReleaseBufferRequest* request,
                                          dynamiq::v1::ReleaseBufferResponse*) {
  auto worker = Caller(*context, request->worker_id());
  if (!worker.ok()) return Refuse(daemon_, context, worker.status());
  return Refuse(daemon_, context, daemon_.Release(*worker, request->buffer_id()));
}

grpc::ServerUnaryReactor* WorkerService::AllReduce(grpc::CallbackServerContext* context,
                                                   const dynamiq::v1::AllReduceRequest* request,
                                                   dynamiq::v1::AllReduceResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto worker = Caller(*context, request->worker_id());
  if (!worker.ok()) {
    reactor->Finish(Refuse(daemon_, context, worker.status()));
    return reactor;
  }
  Daemon::AllReduceCall call;
  call.worker_id = *worker;
  call.tensor_name = request->tensor_name();
  call.buffer_id = request->buffer_id();
  call.offset_bytes = request->offset_bytes();
  call.num_elements = request->num_elements();
  call.average = request->average();
  if (request->has_submission()) call.submission = request->submission();
  if (request->has_weight()) call.weight = request->weight();
  call.exact = request->exact();
  // The reactor and the response stay valid until Finish, which the completion calls exactly once.
  auto finish = [reactor, response](absl::StatusOr<Job::Result> r) {
    if (!r.ok()) {
      reactor->Finish(common::ToGrpcStatus(r.status()));
      return;
    }
    response->set_sequence(r->sequence);
    response->set_config_epoch(r->config_epoch);
    response->set_codec(std::string(kernels::CodecName(r->config.codec.id)));
    response->set_bits(r->config.codec.bits);
    response->set_wire_bytes(r->wire_bytes);
    if (r->measured_vnmse.has_value()) response->set_measured_vnmse(*r->measured_vnmse);
    response->set_contributors(r->contributors);
    for (uint32_t node : r->nodes) response->add_nodes(node);
    response->set_weight_sum(r->weight_sum);
    reactor->Finish(grpc::Status::OK);
  };
  absl::StatusOr<kernels::DType> dtype = Daemon::WireDType(request->dtype());
  if (!dtype.ok()) {
    daemon_.RefuseAllReduce(call, dtype.status(), std::move(finish));
    return reactor;
  }
  call.dtype = *dtype;
  daemon_.AllReduceAsync(call, std::move(finish));
  return reactor;
}

grpc::Status WorkerService::Unregister(grpc::ServerContext* context, const dynamiq::v1::UnregisterRequest* request,
                                       dynamiq::v1::UnregisterResponse*) {
  auto worker = Caller(*context, request->worker_id());
  if (!worker.ok()) return Refuse(daemon_, context, worker.status());
  return Refuse(daemon_, context, daemon_.Unregister(*worker));
}

grpc::Status WorkerService::OpenSubmissionRing(grpc::ServerContext* context,
                                               const dynamiq::v1::OpenSubmissionRingRequest* request,
                                               dynamiq::v1::OpenSubmissionRingResponse* response) {
  auto worker = Caller(*context, request->worker_id());
  if (!worker.ok()) return Refuse(daemon_, context, worker.status());
  auto ring = daemon_.OpenSubmissionRing(*worker, request->slots());
  if (!ring.ok()) return Refuse(daemon_, context, ring.status());
  response->set_shm_name(ring->shm_name);
  response->set_bytes(ring->bytes);
  response->set_slots(ring->slots);
  return grpc::Status::OK;
}

}  // namespace dynamiq::server
