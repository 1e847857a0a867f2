#include "server/daemon_options.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/codec_info.h"

namespace dynamiq::server {

bool DaemonHasCudaSupport() {
#ifdef DQ_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

bool UsesNccl(const DaemonOptions& o) {
  return o.device == DeviceKind::kCuda && (o.transport.empty() || o.transport == "nccl");
}

bool UsesTcp(const DaemonOptions& o) {
  return o.device != DeviceKind::kCuda && (o.transport.empty() || o.transport == "tcp" || o.transport == "udp");
}

bool UsesDatagrams(const DaemonOptions& o) { return o.device != DeviceKind::kCuda && o.transport == "udp"; }

std::string TransportName(const DaemonOptions& o) {
  if (UsesNccl(o)) return "nccl";
  if (UsesDatagrams(o)) return "udp";
  return UsesTcp(o) ? "tcp" : "gloo";
}

absl::Status CheckConfigForTransport(const JobConfig& config, const DaemonOptions& o) {
  if (config.lossy_phase > absl::ZeroDuration() && !UsesDatagrams(o)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the loss-tolerant all-reduce (lossy_phase_ms > 0) needs datagrams between the nodes: dynamiqd "
                     "--transport=udp on every node (this cluster runs --transport=",
                     TransportName(o), ")"));
  }
  return absl::OkStatus();
}

NodeSettings ClusterSettings(const DaemonOptions& o) {
  auto number = [](double v) { return absl::StrFormat("%g", v); };
  auto boolean = [](bool v) { return std::string(v ? "true" : "false"); };
  const JobConfig& c = o.default_config;
  NodeSettings s = {
      {"device", std::string(DeviceKindName(o.device))},
      {"transport", TransportName(o)},
      {"step_budget", boolean(o.step_budget)},
      {"arc_topk_error_feedback", boolean(o.arc_topk_error_feedback)},
      {"arc_topk_momentum", number(o.arc_topk_momentum)},
      {"error_feedback_mib", absl::StrCat(o.error_feedback_mib)},
      {"heartbeat_timeout", number(absl::ToDoubleSeconds(o.heartbeat_timeout))},
      {"min_nodes", absl::StrCat(o.min_nodes)},
      // New jobs start with these on every node (a later change is published to all).
      {"codec", std::string(kernels::CodecName(c.codec.id))},
      {"bits", number(c.codec.bits)},
      {"topology", std::string(engine::TopologyName(c.topology))},
      {"min_compress_elements", absl::StrCat(c.min_compress_elements)},
      {"target_vnmse", number(c.error_budget ? c.error_budget->target_vnmse : 0)},
      {"lossy_phase_ms", number(absl::ToDoubleMilliseconds(c.lossy_phase))},
      {"udp_send_mbps", number(o.udp_send_mbps)},
  };
  if (c.error_budget) {
    s.emplace_back("min_bits", number(c.error_budget->min_bits));
    s.emplace_back("max_bits", number(c.error_budget->max_bits));
    s.emplace_back("budget_sample_rate", number(c.error_budget->sample_rate));
  }
  return s;
}

absl::Status CheckAnotherJob(const DaemonOptions& o, size_t live_jobs, absl::string_view job) {
  if (live_jobs >= o.max_jobs) {
    return absl::ResourceExhaustedError(absl::StrCat("dynamiqd already runs ", live_jobs,
                                                     " jobs, its limit (--max_jobs); job ", job,
                                                     " can start when one of them ends"));
  }
  if (live_jobs >= 1 && UsesNccl(o) && o.num_nodes > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "dynamiqd --device=cuda --transport=nccl runs one job at a time on a cluster of several nodes (NCCL needs "
        "every node to launch the jobs' collectives on its GPU in the same order); job ",
        job,
        " can start when the running one ends. To run several jobs on these GPUs at once, use --transport=gloo "
        "(the hybrid path), or one dynamiqd per job (its own --cuda_device, --listen and --worker_socket)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateDaemonOptions(const DaemonOptions& o) {
  if (o.num_nodes == 0 || o.node_rank >= o.num_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--node_rank ", o.node_rank, " is not in a cluster of ", o.num_nodes, " nodes"));
  }
  if (o.coordinator.empty() && o.num_nodes > 1 && o.node_rank != 0) {
    return absl::InvalidArgumentError("--coordinator is required on nodes other than node 0");
  }
  if (o.min_nodes > o.num_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--min_nodes ", o.min_nodes, " is more than the cluster's ", o.num_nodes, " nodes"));
  }
  if (o.heartbeat_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--heartbeat_timeout must be >= 0 (0: no heartbeats)");
  }
  if (o.metrics_port < -1 || o.metrics_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_port must be -1 (off), 0 (any free port) or a port, got ", o.metrics_port));
  }
  if (!(o.error_sample_rate >= 0 && o.error_sample_rate <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--error_sample_rate must be in [0, 1], got ", o.error_sample_rate));
  }
  if (!(o.arc_topk_momentum > 0 && o.arc_topk_momentum <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--arc_topk_momentum must be in (0, 1], got ", o.arc_topk_momentum));
  }
  if (o.error_feedback_mib > (size_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--error_feedback_mib must be at most 1073741824 (1 PiB), got ", o.error_feedback_mib));
  }
  DQ_RETURN_IF_ERROR(common::CheckPoolThreads("--codec_threads", o.codec_threads));
  if (!o.transport.empty() && o.transport != "gloo" && o.transport != "tcp" && o.transport != "udp" &&
      o.transport != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport must be gloo, tcp, udp or nccl, got '", o.transport, "'"));
  }
  if (!(o.udp_send_mbps >= 0 && o.udp_send_mbps <= 1e6)) {
    return absl::InvalidArgumentError(absl::StrCat("--udp_send_mbps must be in [0, 1e6], got ", o.udp_send_mbps));
  }
  if (absl::Status s = CheckConfigForTransport(o.default_config, o); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("default compression of new jobs: ", s.message()));
  }
  if (o.device != DeviceKind::kCuda) {
    if (o.transport == "nccl") {
      return absl::InvalidArgumentError(
          "--transport=nccl needs --device=cuda: a CPU node reduces in host memory and moves it over Gloo or TCP");
    }
    return absl::OkStatus();
  }
  if (o.transport == "tcp" || o.transport == "udp") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--transport=", o.transport, " is for CPU nodes (GPU nodes: nccl, or gloo for the hybrid path over Ethernet)"));
  }
  if (!DaemonHasCudaSupport()) {
    return absl::FailedPreconditionError(
        "--device=cuda: this dynamiqd was built without CUDA and NCCL (DQ_ENABLE_CUDA=OFF, or nvcc, nccl.h or "
        "libnccl not found at build time); run --device=cpu or rebuild on a machine with the CUDA toolkit and NCCL");
  }
  if (o.cuda_device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--cuda_device must be 0 or more, got ", o.cuda_device));
  }
  if (absl::Status s = CheckConfigForDevice(o.default_config, DeviceKind::kCuda); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("default compression of new jobs: ", s.message()));
  }
  if (!o.security.cluster_secret_file.empty()) {
    return absl::InvalidArgumentError(
        "--cluster_secret_file cannot be used with --device=cuda: the NCCL transfers between GPU nodes carry no "
        "message authentication (docs/security.md)");
  }
  return absl::OkStatus();
}

}  // namespace dynamiq::server
