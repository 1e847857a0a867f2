#include "server/cluster_job_coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/host_transport.h"
#include "engine/store.h"
#include "engine/transport_with_datagrams.h"
#include "engine/udp_transport.h"
#include "server/counting_transport.h"
#ifdef DQ_HAVE_NCCL
#include "engine/host_staged_transport.h"
#include "engine/nccl_transport.h"
#endif

namespace dynamiq::server {
namespace {

// How many group views' records the store keeps (a node that looks for the newest needs only that).
constexpr uint64_t kKeptViews = 16;
// How often a node waiting in a job's rendezvous checks whether another node failed the collective.
constexpr absl::Duration kRendezvousPoll = absl::Milliseconds(250);

// The job's connection mesh, where its transport is tcp.
std::unique_ptr<engine::TcpMesh> MakeMesh(const JobTransportSettings& settings) {
  if (!settings.tcp) return nullptr;
  engine::TcpTransportOptions options;
  options.hostname = settings.peer_host;
  options.timeout = settings.timeout;
  options.key = settings.key;
  return std::make_unique<engine::TcpMesh>(static_cast<int>(settings.node_rank), static_cast<int>(settings.num_nodes),
                                           options);
}

}  // namespace

ClusterJobCoordinator::ClusterJobCoordinator(Cluster& cluster, std::string job_id, uint64_t incarnation,
                                             JobTransportSettings settings)
    : cluster_(cluster),
      job_id_(std::move(job_id)),
      incarnation_(incarnation),
      settings_(std::move(settings)),
      mesh_(MakeMesh(settings_)) {}

absl::StatusOr<std::unique_ptr<engine::Transport>> ClusterJobCoordinator::Connect(const GroupView& view,
                                                                                  uint64_t sequence) {
  if (!view.is_member()) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", view.node_rank(), " is not a member of ", view.ToString()));
  }
  engine::PrefixStore prefixed(Cluster::RendezvousPrefix(job_id_, incarnation_, view.epoch(), sequence),
                               cluster_.store());
  // A node that fails this collective instead of joining publishes why, a silent member
  // (server/membership.h) never comes, and a newer view may apply: stop waiting then.
  engine::InterruptibleStore scoped(
      prefixed,
      [this, sequence, &view]() -> absl::Status {
        if (std::optional<Cluster::Failure> cause = cluster_.PublishedFailure(job_id_, incarnation_, sequence)) {
          return absl::UnavailableError(
              absl::StrCat("node ", cause->node, " failed the collective instead of joining it"));
        }
        return ConnectWaitEnds(view, sequence);
      },
      kRendezvousPoll);
  const int rank = view.my_index();
  const int size = static_cast<int>(view.size());
#ifdef DQ_HAVE_NCCL
  if (settings_.device == DeviceKind::kCuda && settings_.nccl) {
    // The device all-reduce drives the NCCL transport itself (no per-peer byte counting).
    absl::StatusOr<std::unique_ptr<engine::Transport>> nccl =
        engine::ConnectNcclTransport(scoped, rank, size, settings_.cuda_device, settings_.timeout);
    if (!nccl.ok()) {
      return common::Restate(nccl.status(),
                             absl::StrCat(nccl.status().message(), cluster_.IncarnationHint(job_id_, incarnation_)));
    }
    return nccl;
  }
#endif
  absl::StatusOr<std::unique_ptr<engine::Transport>> host =
      settings_.tcp ? ConnectOverMesh(scoped, view, sequence)
                    : engine::ConnectHostTransport("gloo", scoped, rank, size, settings_.peer_host, settings_.timeout);
  if (!host.ok()) {
    // Nodes at different incarnations never meet: say so rather than only which key was missing.
    return common::Restate(host.status(),
                           absl::StrCat(host.status().message(), cluster_.IncarnationHint(job_id_, incarnation_)));
  }
  if (settings_.datagrams) {
    // The view's UDP sockets, under the same rendezvous ("udp/<rank>" beside "tcp/<rank>").
    engine::UdpTransportOptions udp;
    udp.hostname = settings_.peer_host;
    udp.timeout = settings_.timeout;
    udp.key = settings_.key;
    absl::StatusOr<std::unique_ptr<engine::UdpTransport>> datagrams =
        engine::ConnectUdpTransport(scoped, rank, size, udp);
    if (!datagrams.ok()) return common::Annotate(datagrams.status(), "udp transport");
    host = std::make_unique<engine::TransportWithDatagrams>(*std::move(host), *std::move(datagrams));
  }
  // Counts bytes per peer node (dynamiq_peer_bytes_total).
  auto counted = std::make_unique<CountingTransport>(*std::move(host), settings_.metrics, view.members());
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

absl::StatusOr<std::unique_ptr<engine::Transport>> ClusterJobCoordinator::ConnectOverMesh(engine::Store& store,
                                                                                          const GroupView& view,
                                                                                          uint64_t sequence) {
  absl::MutexLock lock(&mesh_mu_);  // one view at a time, so the counts' change is this connect's
  const engine::TcpMesh::Counts before = mesh_->counts();
  std::vector<int> members(view.members().begin(), view.members().end());
  absl::StatusOr<std::unique_ptr<engine::Transport>> t =
      mesh_->Connect(store, members, engine::TcpMeshSession{view.epoch(), sequence});
  const engine::TcpMesh::Counts after = mesh_->counts();
  if (settings_.metrics != nullptr && t.ok()) {
    settings_.metrics->OnPeerConnections(after.made - before.made, after.kept - before.kept);
  }
  return t;
}

absl::Status ClusterJobCoordinator::ConnectWaitEnds(const GroupView& view, uint64_t sequence) {
  // A newer view that applies to this collective (claimed when a member went silent), or one that
  // leaves this node out: the members meet there, not here.
  absl::StatusOr<GroupView> newest = NewestView(view);
  if (newest.ok() && newest->epoch() > view.epoch() && (newest->first_sequence() <= sequence || !newest->is_member())) {
    return absl::AbortedError(absl::StrCat(newest->ToString(), " was claimed while node ", view.node_rank(),
                                           " waited to connect in ", view.ToString()));
  }
  const LiveSet live = cluster_.live();
  const std::vector<uint32_t> silent = live.Silent(view.members());
  if (silent.empty()) return absl::OkStatus();
  const uint32_t min_nodes = live.min_nodes == 0 ? settings_.num_nodes : live.min_nodes;
  const uint32_t left = view.size() - static_cast<uint32_t>(silent.size());
  if (left < min_nodes) {
    return absl::FailedPreconditionError(
        absl::StrCat(live.DescribeSilent(silent), " stopped heartbeating to the coordinator; job ", job_id_, "'s ",
                     view.ToString(), " would shrink to ", left, left == 1 ? " node" : " nodes",
                     ", below --min_nodes=", min_nodes, ", so its collectives fail until the node is back"));
  }
  return absl::OkStatus();  // the view's lowest live member claims the next view (Job::OnMembership)
}

absl::StatusOr<GroupView> ClusterJobCoordinator::ClaimView(const GroupView& current, std::vector<uint32_t> members,
                                                           uint64_t first_sequence) {
  const uint64_t epoch = current.epoch() + 1;
  DQ_ASSIGN_OR_RETURN(GroupView view, GroupView::Make(epoch, std::move(members), first_sequence, settings_.num_nodes,
                                                      settings_.node_rank));
  // The epoch's record is decided by compare-and-set (the first claimant's stays); then the newest
  // epoch moves on to it (whichever claimant gets there first), so a node that reads the newest
  // epoch finds its record.
  const std::string latest_key = Cluster::LatestViewKey(job_id_, incarnation_);
  const std::string key = Cluster::ViewKey(job_id_, incarnation_, epoch);
  DQ_ASSIGN_OR_RETURN(bool written, cluster_.store().CompareAndSet(key, std::nullopt, view.Encode()));
  (void)written;
  DQ_ASSIGN_OR_RETURN(std::string record, cluster_.store().Get(key, absl::ZeroDuration()));
  std::optional<std::string> expected;
  if (current.epoch() > 0) expected = absl::StrCat(current.epoch());
  DQ_ASSIGN_OR_RETURN(bool claimed, cluster_.store().CompareAndSet(latest_key, expected, absl::StrCat(epoch)));
  if (!claimed) {
    DQ_ASSIGN_OR_RETURN(std::string latest, cluster_.store().Get(latest_key, absl::ZeroDuration()));
    if (latest != absl::StrCat(epoch)) {
      return absl::FailedPreconditionError(absl::StrCat("cannot claim view ", epoch, " of job ", job_id_,
                                                        " after view ", current.epoch(), ": view ",
                                                        absl::CHexEscape(latest), " is the newest"));
    }
  }
  if (claimed && epoch > kKeptViews) {
    engine::Store::Deletion deletion;
    deletion.keys.push_back(Cluster::ViewKey(job_id_, incarnation_, epoch - kKeptViews));
    (void)cluster_.store().Delete(deletion);  // best effort: an old record only takes room
  }
  return GroupView::Decode(record, settings_.num_nodes, settings_.node_rank);
}

absl::StatusOr<GroupView> ClusterJobCoordinator::NewestView(const GroupView& current) {
  DQ_ASSIGN_OR_RETURN(std::vector<GroupView> newer, ViewsAfter(current, /*newest_only=*/true));
  return newer.empty() ? current : newer.back();
}

absl::StatusOr<std::vector<GroupView>> ClusterJobCoordinator::ViewsAfter(const GroupView& current) {
  return ViewsAfter(current, /*newest_only=*/false);
}

absl::StatusOr<std::vector<GroupView>> ClusterJobCoordinator::ViewsAfter(const GroupView& current, bool newest_only) {
  std::optional<std::optional<std::string>> read_at_boundary;
  {
    absl::MutexLock lock(&mu_);
    if (boundary_view_.has_value() && absl::Now() - boundary_view_time_ < kBoundaryReadLife) {
      read_at_boundary = std::move(boundary_view_);
    }
    boundary_view_.reset();
  }
  std::optional<std::string> latest;
  if (read_at_boundary.has_value()) {
    latest = *std::move(read_at_boundary);
  } else {
    absl::StatusOr<std::string> read =
        cluster_.store().Get(Cluster::LatestViewKey(job_id_, incarnation_), absl::ZeroDuration());
    if (!read.ok() && !engine::IsKeyNotSet(read.status())) return read.status();
    if (read.ok()) latest = *std::move(read);
  }
  if (!latest.has_value()) return std::vector<GroupView>{};  // never changed: every node
  uint64_t newest = 0;
  if (!absl::SimpleAtoi(*latest, &newest)) {
    return absl::DataLossError(absl::StrCat("job ", job_id_, "'s newest view is '", absl::CHexEscape(*latest), "'"));
  }
  std::vector<GroupView> views;
  if (newest <= current.epoch()) return views;
  // The store keeps the newest kKeptViews records (ClaimView deletes older ones).
  uint64_t first = std::max(current.epoch() + 1, newest >= kKeptViews ? newest - kKeptViews + 1 : 1);
  if (newest_only) first = newest;
  for (uint64_t epoch = first; epoch <= newest; ++epoch) {
    DQ_ASSIGN_OR_RETURN(std::string record,
                        cluster_.store().Get(Cluster::ViewKey(job_id_, incarnation_, epoch), absl::ZeroDuration()));
    DQ_ASSIGN_OR_RETURN(GroupView view, GroupView::Decode(record, settings_.num_nodes, settings_.node_rank));
    views.push_back(std::move(view));
  }
  return views;
}

bool ClusterJobCoordinator::WantsToJoin(uint32_t node) {
  return cluster_.store().Get(Cluster::JoinKey(job_id_, incarnation_, node), absl::ZeroDuration()).ok();
}

void ClusterJobCoordinator::Admitted(const std::vector<uint32_t>& nodes) {
  engine::Store::Deletion deletion;
  for (uint32_t node : nodes) deletion.keys.push_back(Cluster::JoinKey(job_id_, incarnation_, node));
  (void)cluster_.store().Delete(deletion);  // best effort: a node already admitted is not admitted again
}

absl::StatusOr<bool> ClusterJobCoordinator::PollConfig(uint64_t sequence, uint64_t* epoch, JobConfig* config) {
  std::optional<std::optional<std::string>> latest_view;
  absl::StatusOr<bool> changed = cluster_.PollConfig(job_id_, incarnation_, sequence, epoch, config, &latest_view);
  absl::MutexLock lock(&mu_);
  boundary_view_ = std::move(latest_view);
  boundary_view_time_ = absl::Now();
  return changed;
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
