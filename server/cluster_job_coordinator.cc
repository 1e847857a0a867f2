#include "server/cluster_job_coordinator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/host_transport.h"
#include "engine/store.h"
#include "server/counting_transport.h"
#ifdef DQ_HAVE_NCCL
#include "engine/host_staged_transport.h"
#include "engine/nccl_transport.h"
#endif

namespace dynamiq::server {
namespace {

// How often a node waiting in a job's rendezvous checks whether another node failed the collective.
constexpr absl::Duration kRendezvousPoll = absl::Milliseconds(250);

}  // namespace

ClusterJobCoordinator::ClusterJobCoordinator(Cluster& cluster, std::string job_id, uint64_t incarnation,
                                             JobTransportSettings settings)
    : cluster_(cluster), job_id_(std::move(job_id)), incarnation_(incarnation), settings_(std::move(settings)) {}

absl::StatusOr<std::unique_ptr<engine::Transport>> ClusterJobCoordinator::Connect(uint64_t generation,
                                                                                  uint64_t sequence) {
  engine::PrefixStore prefixed(Cluster::RendezvousPrefix(job_id_, incarnation_, generation), cluster_.store());
  // A node that fails this collective instead of joining publishes why: stop waiting for it then.
  engine::InterruptibleStore scoped(
      prefixed,
      [this, sequence]() -> absl::Status {
        if (std::optional<Cluster::Failure> cause = cluster_.PublishedFailure(job_id_, incarnation_, sequence)) {
          return absl::UnavailableError(
              absl::StrCat("node ", cause->node, " failed the collective instead of joining it"));
        }
        return absl::OkStatus();
      },
      kRendezvousPoll);
  const int rank = static_cast<int>(settings_.node_rank);
  const int size = static_cast<int>(settings_.num_nodes);
#ifdef DQ_HAVE_NCCL
  if (settings_.device == DeviceKind::kCuda && settings_.nccl) {
    // The device all-reduce drives the NCCL transport itself (no per-peer byte counting).
    absl::StatusOr<std::unique_ptr<engine::Transport>> nccl =
        engine::ConnectNcclTransport(scoped, rank, size, settings_.cuda_device, settings_.timeout);
    if (!nccl.ok()) {
      return absl::Status(nccl.status().code(),
                          absl::StrCat(nccl.status().message(), cluster_.IncarnationHint(job_id_, incarnation_)));
    }
    return nccl;
  }
#endif
  absl::StatusOr<std::unique_ptr<engine::Transport>> host = engine::ConnectHostTransport(
      settings_.tcp ? "tcp" : "gloo", scoped, rank, size, settings_.peer_host, settings_.timeout, settings_.key);
  if (!host.ok()) {
    // Nodes at different incarnations never meet: say so rather than only which key was missing.
    return absl::Status(host.status().code(),
                        absl::StrCat(host.status().message(), cluster_.IncarnationHint(job_id_, incarnation_)));
  }
  // Counts bytes per peer node (dynamiq_peer_bytes_total).
  auto counted = std::make_unique<CountingTransport>(*std::move(host), settings_.metrics);
#ifdef DQ_HAVE_NCCL
  if (settings_.device == DeviceKind::kCuda) {
    // The hybrid path: the device all-reduce's chunks staged through pinned host memory.
    DQ_ASSIGN_OR_RETURN(std::unique_ptr<engine::HostStagedTransport> staged,
                        engine::HostStagedTransport::Create(std::move(counted), settings_.cuda_device));
    return std::unique_ptr<engine::Transport>(std::move(staged));
  }
#endif
  return std::unique_ptr<engine::Transport>(std::move(counted));
}

absl::StatusOr<bool> ClusterJobCoordinator::PollConfig(uint64_t sequence, uint64_t* epoch, JobConfig* config) {
  return cluster_.PollConfig(job_id_, incarnation_, sequence, epoch, config);
}

absl::Status ClusterJobCoordinator::ReportFailure(uint64_t sequence, const absl::Status& cause, absl::Time deadline) {
  return cluster_.ReportFailure(job_id_, incarnation_, sequence, cause, deadline);
}

std::optional<FailureCause> ClusterJobCoordinator::LookupFailure(uint64_t sequence, absl::Time deadline) {
  std::optional<Cluster::Failure> failure = cluster_.LookupFailure(job_id_, incarnation_, sequence, deadline);
  if (!failure.has_value()) return std::nullopt;
  return FailureCause{failure->node, failure->status};
}

}  // namespace dynamiq::server
