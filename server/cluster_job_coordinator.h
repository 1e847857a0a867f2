// ClusterJobCoordinator: a job's JobCoordinator (server/job_coordinator.h) on a daemon of a
// cluster: its incarnation's keys in the Cluster (group views, configuration changes, failure
// causes), and the
// transport of the node's device kind (tcp or gloo on CPU nodes, counted per peer node; NCCL or
// staged gloo on GPU nodes), connected through the Cluster's store under the incarnation's
// rendezvous prefix. With tcp, every view's transport is a view over one connection mesh
// (engine/tcp_mesh.h): pairs that stay in the group keep their connection. Thread-safe (the
// Cluster is).
#ifndef DQ_SERVER_CLUSTER_JOB_COORDINATOR_H_
#define DQ_SERVER_CLUSTER_JOB_COORDINATOR_H_

#include <stdint.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/hmac.h"
#include "engine/tcp_mesh.h"
#include "engine/transport.h"
#include "server/cluster.h"
#include "server/job_config.h"
#include "server/job_coordinator.h"
#include "server/metrics.h"

namespace dynamiq::server {

// Where a job's transport connects and how: the node, its device kind, and what counts bytes.
struct JobTransportSettings {
  uint32_t node_rank = 0;
  uint32_t num_nodes = 1;
  DeviceKind device = DeviceKind::kCpu;
  int cuda_device = 0;
  bool nccl = false;  // kCuda: NCCL between nodes; else Gloo staged through pinned host memory
  bool tcp = false;   // kCpu: engine/tcp_transport.h instead of Gloo's transport
  // kCpu with tcp: a UDP transport per view beside it (engine/transport_with_datagrams.h,
  // --transport=udp) for the loss-tolerant all-reduce.
  bool datagrams = false;
  absl::Duration timeout;
  std::string peer_host;       // the host this node's transport listens on
  Metrics* metrics = nullptr;  // bytes per peer node (CPU nodes)
  // The job's key when the cluster has a secret: the TCP transport's hellos prove it.
  std::optional<common::HmacSha256::Digest> key;
};

class ClusterJobCoordinator final : public JobCoordinator {
 public:
  ClusterJobCoordinator(Cluster& cluster, std::string job_id, uint64_t incarnation, JobTransportSettings settings);

  absl::StatusOr<std::unique_ptr<engine::Transport>> Connect(const GroupView& view, uint64_t sequence) override;
  absl::StatusOr<GroupView> ClaimView(const GroupView& current, std::vector<uint32_t> members,
                                      uint64_t first_sequence) override;
  absl::StatusOr<GroupView> NewestView(const GroupView& current) override;
  absl::StatusOr<std::vector<GroupView>> ViewsAfter(const GroupView& current) override;
  bool WantsToJoin(uint32_t node) override;
  void Admitted(const std::vector<uint32_t>& nodes) override;
  absl::StatusOr<bool> PollConfig(uint64_t sequence, uint64_t* epoch, JobConfig* config) override;
  absl::Status ReportFailure(uint64_t sequence, const absl::Status& cause, absl::Time deadline) override;
  std::optional<FailureCause> LookupFailure(uint64_t sequence, absl::Time deadline) override;

 private:
  // Why a node waiting to connect in `view` for collective `sequence` should stop: ABORTED once a
  // newer view applies to the collective or leaves this node out (the caller connects in it, or
  // fails the collective), FAILED_PRECONDITION when a member is silent (server/membership.h) and
  // the view cannot shrink past --min_nodes; OK to wait on (a claim without the silent member may
  // still come).
  absl::Status ConnectWaitEnds(const GroupView& view, uint64_t sequence);
  // The tcp transport of `view` for collective `sequence`, over the job's mesh.
  absl::StatusOr<std::unique_ptr<engine::Transport>> ConnectOverMesh(engine::Store& store, const GroupView& view,
                                                                     uint64_t sequence);
  // The views claimed after `current` (only the newest, if `newest_only`).
  absl::StatusOr<std::vector<GroupView>> ViewsAfter(const GroupView& current, bool newest_only);

  Cluster& cluster_;
  const std::string job_id_;
  const uint64_t incarnation_;
  const JobTransportSettings settings_;
  // The node's connections to the others for every view of the job (--transport=tcp, else null:
  // a view keeps the connections of the view before it; engine/tcp_mesh.h).
  const std::unique_ptr<engine::TcpMesh> mesh_;
  absl::Mutex mesh_mu_;  // held across a connect over it

  // The newest-view record PollConfig read with the configuration (one round trip per boundary),
  // for the ViewsAfter that follows it at the same boundary (Job polls, then refreshes its group
  // view): used once, and only within kBoundaryReadLife of the read; otherwise ViewsAfter reads it.
  static constexpr absl::Duration kBoundaryReadLife = absl::Seconds(1);
  absl::Mutex mu_;
  std::optional<std::optional<std::string>> boundary_view_ ABSL_GUARDED_BY(mu_);
  absl::Time boundary_view_time_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_CLUSTER_JOB_COORDINATOR_H_
