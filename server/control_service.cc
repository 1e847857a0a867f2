#include "server/control_service.h"

#include <algorithm>

#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "server/build_info.h"
#include "server/error_budget_service.h"
#include "server/request_names.h"

namespace dynamiq::server {
namespace {

// Every error a handler returns is a refused request: counted and logged (rate-limited) with the
// caller's address.
grpc::Status Refuse(Daemon& daemon, const grpc::ServerContext& context, const absl::Status& status) {
  if (!status.ok()) daemon.RecordRejected(status, absl::StrCat("an operator call from ", context.peer()));
  return common::ToGrpcStatus(status);
}

}  // namespace

grpc::Status ControlService::Authorize(const grpc::ServerContext& context) {
  if (auth_ == nullptr) return grpc::Status::OK;
  absl::Status s = auth_->Check(context);
  return s.ok() ? grpc::Status::OK : Refuse(daemon_, context, s);
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
  response->set_transport(TransportName(daemon_.options()));
  response->set_device(std::string(DeviceKindName(daemon_.options().device)));
  for (uint32_t node : daemon_.LiveNodes()) response->add_live_nodes(node);
  for (const auto& [id, s] : daemon_.JobStatuses()) {
    dynamiq::v1::JobStatus* j = response->add_jobs();
    j->set_job_id(id);
    j->set_incarnation(s.incarnation);
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
    for (const auto& [rank, seconds] : s.local_wait_seconds) (*j->mutable_local_wait_seconds())[rank] = seconds;
    for (const auto& [node, seconds] : s.node_wait_seconds) (*j->mutable_node_wait_seconds())[node] = seconds;
    j->set_view_epoch(s.view_epoch);
    for (uint32_t node : s.view_members) j->add_view_nodes(node);
    j->set_lossy_datagrams_expected(s.lossy_expected);
    j->set_lossy_datagrams_arrived(s.lossy_arrived);
    j->set_lossy_drift_elements(s.lossy_drift_elements);
    if (daemon_.error_budget() == nullptr) continue;
    if (auto state = daemon_.error_budget()->State(id)) {
      const CompressionController::Stats& st = state->stats;
      dynamiq::v1::ErrorBudgetStatus* b = j->mutable_error_budget();
      b->set_bits(st.bits);
      b->set_epoch(st.epoch);
      b->set_last_vnmse(st.last_vnmse);
      b->set_noise_sigma(st.noise_sigma);
      b->set_saturated(st.saturated);
      b->set_decision_pending(st.decision_pending);
      b->set_samples_used(st.samples_used);
      b->set_samples_stale(st.samples_stale);
      b->set_raises(st.raises);
      b->set_lowers(st.lowers);
      b->set_clamps(st.clamps);
      b->set_rejected(st.rejected);
      b->set_cooldown_left(static_cast<uint32_t>(std::max(0, st.cooldown_left)));
    }
  }
  return grpc::Status::OK;
}

grpc::Status ControlService::SetCompression(grpc::ServerContext* context,
                                            const dynamiq::v1::SetCompressionRequest* request,
                                            dynamiq::v1::SetCompressionResponse* response) {
  if (grpc::Status s = Authorize(*context); !s.ok()) return s;
  if (absl::Status bad = CheckRequestName("job id", request->job_id(), kMaxJobIdBytes); !bad.ok()) {
    return Refuse(daemon_, *context, bad);
  }
  std::optional<uint64_t> expected;
  if (request->has_expected_epoch()) expected = request->expected_epoch();
  const std::string& job_id = request->job_id();
  const dynamiq::v1::CompressionConfig& change = request->config();
  auto published = daemon_.SetCompression(
      job_id, [&](const JobConfig& newest) { return ApplyCompressionChange(newest, change, job_id); }, expected);
  if (!published.ok()) return Refuse(daemon_, *context, published.status());
  response->set_epoch(published->epoch);
  ToProto(published->config, response->mutable_config());
  return grpc::Status::OK;
}

grpc::Status ControlService::GetFlightRecorder(grpc::ServerContext* context,
                                               const dynamiq::v1::GetFlightRecorderRequest* request,
                                               dynamiq::v1::GetFlightRecorderResponse* response) {
  if (grpc::Status s = Authorize(*context); !s.ok()) return s;
  if (absl::Status bad = CheckRequestName("job id", request->job_id(), kMaxJobIdBytes, /*allow_empty=*/true);
      !bad.ok()) {
    return Refuse(daemon_, *context, bad);
  }
  std::vector<std::string> jobs;
  if (request->job_id().empty()) {
    jobs = daemon_.RecordedJobs();  // retired jobs' records stay readable too
  } else {
    jobs.push_back(request->job_id());
  }
  for (const std::string& id : jobs) {
    auto records = daemon_.FlightRecorder(id, request->limit());
    if (!records.ok()) return Refuse(daemon_, *context, records.status());
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
      out->set_view_epoch(r.view_epoch);
      for (uint32_t node : r.nodes) out->add_nodes(node);
      out->set_contributors(r.contributors);
    }
    if (daemon_.error_budget() == nullptr) continue;
    for (const ErrorBudgetService::Event& e : daemon_.error_budget()->Events(id, request->limit())) {
      dynamiq::v1::ErrorBudgetEvent* out = response->add_error_budget_events();
      out->set_job_id(id);
      out->set_time_unix_nanos(absl::ToUnixNanos(e.time));
      out->set_kind(e.kind);
      out->set_target_vnmse(e.target_vnmse);
      out->set_from_bits(e.from_bits);
      out->set_bits(e.bits);
      out->set_measured_vnmse(e.measured_vnmse);
      out->set_predicted_vnmse(e.predicted_vnmse);
      out->set_based_on_epoch(e.based_on_epoch);
      out->set_epoch(e.epoch);
      out->set_reason(e.reason);
    }
  }
  return grpc::Status::OK;
}

}  // namespace dynamiq::server
