#include "server/control_service.h"

#include "absl/time/time.h"
#include "server/build_info.h"
#include "server/rendezvous_service.h"
#include "server/worker_service.h"

namespace dynamiq::server {
namespace {

// Every error a handler returns (but a collective's own failure) is a refused request.
grpc::Status Refuse(Daemon& daemon, const absl::Status& status) {
  daemon.RecordRejected(status);
  return ToGrpcStatus(status);
}

}  // namespace

grpc::Status ControlService::Authorize(const grpc::ServerContext& context) {
  if (auth_ == nullptr) return grpc::Status::OK;
  absl::Status s = auth_->Check(context);
  return s.ok() ? grpc::Status::OK : Refuse(daemon_, s);
}

grpc::Status ControlService::GetStatus(grpc::ServerContext* context, const dynamiq::v1::GetStatusRequest*,
                                       dynamiq::v1::GetStatusResponse* response) {
  if (grpc::Status s = Authorize(*context); !s.ok()) return s;
  response->set_node_rank(daemon_.options().node_rank);
  response->set_num_nodes(daemon_.options().num_nodes);
  for (const std::string& m : daemon_.members()) response->add_members(m);
  response->set_version(std::string(BuildVersion()));
  response->set_git_commit(std::string(BuildGitCommit()));
  response->set_metrics_address(daemon_.metrics_address());
  response->set_error_sample_rate(daemon_.error_sample_rate());
  for (const auto& [id, s] : daemon_.JobStatuses()) {
    dynamiq::v1::JobStatus* j = response->add_jobs();
    j->set_job_id(id);
    j->set_workers(s.workers);
    j->set_config_epoch(s.config_epoch);
    ToProto(s.config, j->mutable_config());
    j->set_inflight(s.inflight);
    j->set_completed(s.completed);
    j->set_failed(s.failed);
    j->set_payload_bytes(s.payload_bytes);
    j->set_bus_bytes(s.bus_bytes);
    j->set_wire_bytes(s.wire_bytes);
    j->set_duration_seconds_sum(s.duration_seconds);
    j->set_last_vnmse(s.last_vnmse);
    j->set_error_samples(s.error_samples);
  }
  return grpc::Status::OK;
}

grpc::Status ControlService::SetCompression(grpc::ServerContext* context,
                                            const dynamiq::v1::SetCompressionRequest* request,
                                            dynamiq::v1::SetCompressionResponse* response) {
  if (grpc::Status s = Authorize(*context); !s.ok()) return s;
  const auto& c = request->config();
  auto config = MakeJobConfig(c.codec(), c.bits(), c.topology(), c.min_compress_elements(), c.allocator());
  if (!config.ok()) return Refuse(daemon_, config.status());
  auto epoch = daemon_.SetCompression(request->job_id(), *config, request->expected_epoch());
  if (!epoch.ok()) return Refuse(daemon_, epoch.status());
  response->set_epoch(*epoch);
  return grpc::Status::OK;
}

grpc::Status ControlService::GetFlightRecorder(grpc::ServerContext* context,
                                               const dynamiq::v1::GetFlightRecorderRequest* request,
                                               dynamiq::v1::GetFlightRecorderResponse* response) {
  if (grpc::Status s = Authorize(*context); !s.ok()) return s;
  std::vector<std::string> jobs;
  if (request->job_id().empty()) {
    for (const auto& [id, s] : daemon_.JobStatuses()) jobs.push_back(id);
  } else {
    jobs.push_back(request->job_id());
  }
  for (const std::string& id : jobs) {
    auto records = daemon_.FlightRecorder(id, request->limit());
    if (!records.ok()) return Refuse(daemon_, records.status());
    for (const CollectiveRecord& r : *records) {
      dynamiq::v1::CollectiveRecord* out = response->add_records();
      out->set_sequence(r.sequence);
      out->set_job_id(id);
      out->set_tensor_name(r.tensor_name);
      out->set_num_elements(r.num_elements);
      ToProto(r.config, out->mutable_config());
      out->set_config_epoch(r.config_epoch);
      out->set_state(r.state);
      out->set_error(r.error);
      out->set_start_unix_nanos(absl::ToUnixNanos(r.start));
      out->set_seconds(r.seconds);
      out->set_wire_bytes(r.wire_bytes);
    }
  }
  return grpc::Status::OK;
}

}  // namespace dynamiq::server
