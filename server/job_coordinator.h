// JobCoordinator: what a job of a cluster needs from the other nodes, for one incarnation of the
// job: its group views and cross-node transport, its configuration changes, and the causes of collectives a node
// failed on its own. The daemon implements it over Cluster (server/cluster_job_coordinator.h);
// tests with fakes. Implementations are thread-safe.
#ifndef DQ_SERVER_JOB_COORDINATOR_H_
#define DQ_SERVER_JOB_COORDINATOR_H_

#include <stdint.h>

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/transport.h"
#include "server/group_view.h"
#include "server/job_config.h"

namespace dynamiq::server {

// Why a node failed a collective without running its cross-node part (its workers disagreed, its
// watchdog fired, a worker left, the job stopped there), as the other nodes learn it.
struct FailureCause {
  uint32_t node = 0;
  absl::Status status;  // what that node's workers got
};

class JobCoordinator {
 public:
  virtual ~JobCoordinator() = default;
  // Connects the job's transport among `view`'s members (this node at view.my_index()) for its
  // first collective `sequence`, under rendezvous keys named by both, so a group re-formed after a
  // failure (at the next collective) never meets a connection of another collective. A node that
  // fails `sequence` instead of joining publishes why (ReportFailure): the connect should stop
  // waiting then (UNAVAILABLE), rather than at the timeout.
  virtual absl::StatusOr<std::unique_ptr<engine::Transport>> Connect(const GroupView& view, uint64_t sequence) = 0;
  // Claims view current.epoch() + 1 of `members` from collective `first_sequence` on, by
  // compare-and-set: the view claimed (this node's, or another node's that claimed that epoch
  // first; compare them to know which). FAILED_PRECONDITION when a later view than `current` exists
  // already (NewestView first).
  // By default views never change (a coordinator of a fixed group): UNIMPLEMENTED.
  virtual absl::StatusOr<GroupView> ClaimView(const GroupView& /*current*/, std::vector<uint32_t> /*members*/,
                                              uint64_t /*first_sequence*/) {
    return absl::UnimplementedError("this job's group of nodes is fixed");
  }
  // The newest view claimed, or `current` when none is newer (by default: none ever is).
  virtual absl::StatusOr<GroupView> NewestView(const GroupView& current) { return current; }
  // Every view claimed after `current` that is still kept, by epoch (by default: the newest).
  virtual absl::StatusOr<std::vector<GroupView>> ViewsAfter(const GroupView& current) {
    absl::StatusOr<GroupView> newest = NewestView(current);
    if (!newest.ok()) return newest.status();
    if (newest->epoch() <= current.epoch()) return std::vector<GroupView>{};
    return std::vector<GroupView>{*std::move(newest)};
  }
  // Whether node `node` (a restarted dynamiqd) asks to be admitted to the job (Cluster::JoinKey),
  // and forgetting that once a view admits it. By default nobody asks.
  virtual bool WantsToJoin(uint32_t /*node*/) { return false; }
  virtual void Admitted(const std::vector<uint32_t>& /*nodes*/) {}
  // Looks for a configuration change that applies at or before `sequence`: true with `*epoch`
  // and `*config` set.
  virtual absl::StatusOr<bool> PollConfig(uint64_t sequence, uint64_t* epoch, JobConfig* config) = 0;
  // Publishes this node's cause of failing collective `sequence`, giving up at `deadline`. Best
  // effort: the collective fails either way.
  virtual absl::Status ReportFailure(uint64_t sequence, const absl::Status& cause, absl::Time deadline) = 0;
  // Another node's published cause for collective `sequence`, waiting for it until `deadline`;
  // nullopt when none was published (or it could not be read).
  virtual std::optional<FailureCause> LookupFailure(uint64_t sequence, absl::Time deadline) = 0;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_JOB_COORDINATOR_H_
