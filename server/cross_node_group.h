// CrossNodeGroup: one job's group of nodes as this node sees it: its group view (server/group_view.h),
// the transport connected among the view's members, and the failure causes the nodes exchange when
// the group breaks.
//
// Connections are named, not counted: a connection is made for a collective (the first one it
// carries) in a view, and lives until it breaks or the view changes. Rule: a node drops its
// connection when it fails a collective, on its own (its workers disagreed, its stall check fired, a
// worker left: Decide) or across nodes (a failed exchange: Drop), and connects again for its next
// collective, under that collective's rendezvous keys, so nodes re-form the group at the first
// collective they both run after a break, whatever each failed in between, and a connection never
// pairs two different collectives. A node that fails a collective on its own publishes why, then
// aborts the transport (Announce), in that order, so a node whose exchange the abort cuts short
// finds the cause (WithRemoteCause) instead of a bare connection reset, and a node waiting to
// connect for that collective stops waiting. A node that is not a member of the current view runs
// no cross-node part and publishes nothing (the members' collectives go on without it).
//
// Thread-safe. Connected, Refresh, Drop and WithRemoteCause are for the thread that runs the job's
// collective (one at a time, server/job.h); the others may be called from any thread (handlers,
// the stall check, Stop).
#ifndef DQ_SERVER_CROSS_NODE_GROUP_H_
#define DQ_SERVER_CROSS_NODE_GROUP_H_

#include <stdint.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/transport.h"
#include "server/group_view.h"
#include "server/job_coordinator.h"

namespace dynamiq::server {

class CrossNodeGroup {
 public:
  // Collectives this node fails without running their cross-node part, with why.
  using Failures = std::vector<std::pair<uint64_t, absl::Status>>;  // sequence, cause
  // A break of the group this node has decided on, and the transport it concerns.
  struct Break {
    Failures failures;
    uint64_t transport = 0;  // which connection (a serial number) was current when it was decided
  };

  // `view` is the job's view as it starts (GroupView::Everyone). `coordinator` may be null on one
  // node (there is no group then: Connected fails, and breaks are neither counted nor announced).
  CrossNodeGroup(std::string job_id, GroupView view, std::shared_ptr<JobCoordinator> coordinator);

  // The view the next collective runs in, as far as this node knows.
  GroupView view() const;
  // Asks the coordinator for newer views (one read of its store when there are none) and adopts the
  // newest whose first collective `sequence` has reached (dropping the transport: the members
  // connect again in it); a newer one that applies later waits for its collective. Call it where every member looks, at
  // the same collective boundary (Job: where configuration changes are polled).
  absl::Status Refresh(uint64_t sequence);
  // Makes the view and transport collective `sequence` runs in: adopts a view already known whose
  // first collective `sequence` has reached (as Refresh does), and, when there is no transport,
  // looks up the newest view first and connects among its members (this node a member, more than
  // one of them); a connect cut short by a newer view that applies to `sequence` (a member went
  // silent: server/membership.h) is made again in it. Call it before reading view() for the
  // collective. OK when this node has no transport to make (not a member; a view of one node).
  absl::Status Settle(uint64_t sequence);
  // Settle, then the transport: FAILED_PRECONDITION when this node is not a member of the view, or
  // it has no other member.
  absl::StatusOr<engine::Transport*> Connected(uint64_t sequence);
  // Aborts the transport if it connects any of `silent` (nodes that stopped heartbeating): an
  // exchange waiting on them fails at once, saying `why`, and the next collective connects again.
  // Never waits: false (nothing done) while a connect is under way (its wait ends by itself).
  bool AbortIfIncludes(const std::vector<uint32_t>& silent, const std::string& why);
  // The group broke during an exchange: drops the transport (aborting it first if `abort`: the peers
  // are still inside the exchange), so the next collective connects again.
  void Drop(bool abort);
  // Drops the transport for the next collective (the failed ones are not run here). Call it in the
  // critical section that decides the failures, so that the reducer never runs the next collective
  // in the old group; then Announce, outside any lock.
  Break Decide(Failures failures);
  // Publishes the causes (Report), then aborts the transport if it is still the one the break was
  // decided on (one connected since, for the next collective, is left alone).
  void Announce(const Break& broken);
  // Publishes this node's causes through the coordinator, giving up about a second after the first
  // (best effort: the collectives fail either way).
  void Report(const Failures& failures);
  // Aborts the current transport, if any: a running exchange fails at once.
  void Abort();
  // Drops the transport for good (the job is closing; nothing uses it any more).
  void Close();

  // This node's failure `error` of collective `sequence` across nodes, led by the cause another node
  // published when `error` is what a peer breaking the group looks like here (a reset connection,
  // or a deadline that passed): "collective 5 of job a failed on node 0: <its cause> (here: <error>)",
  // with the cause's code, so every node's workers read the same reason. Otherwise `error` itself;
  // unless it is this node's own abort, this node found the fault (a peer's mismatching or corrupt
  // message) and publishes it for the peers, whose part ended when this node gave up.
  absl::Status WithRemoteCause(uint64_t sequence, absl::Status error);

 private:
  // Whether there are other nodes to tell (a cluster, and this node a member of the view).
  bool HasPeers() const ABSL_LOCKS_EXCLUDED(view_mu_);

  const std::string job_id_;
  const bool single_node_;
  const std::shared_ptr<JobCoordinator> coordinator_;
  // Replaces view_ with the newest pending view whose first collective `sequence` has reached,
  // dropping the transport (Refresh and Settle: whichever comes to the boundary first).
  void AdoptDueView(uint64_t sequence) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SettleLocked(uint64_t sequence) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends the views newer than any known to pending_.
  void AddPending(std::vector<GroupView> views) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads the coordinator's views newer than any known into pending_ (best effort).
  void LearnNewerViews() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // mu_ is held across a connect (which waits for the other members); view() must not wait for
  // that, so view_ is written under both mu_ and view_mu_ and read under either.
  absl::Mutex mu_;
  mutable absl::Mutex view_mu_ ABSL_ACQUIRED_AFTER(mu_);
  GroupView view_;
  // Claimed views newer than view_, by epoch: each applies from its first collective on. All of them
  // are kept, so a node that learns of two at once adopts each at its own boundary.
  std::vector<GroupView> pending_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<engine::Transport> transport_ ABSL_GUARDED_BY(mu_);
  bool reconnect_ ABSL_GUARDED_BY(mu_) = false;         // decided breaks: connect again for the next collective
  uint64_t transport_serial_ ABSL_GUARDED_BY(mu_) = 0;  // counts the transports connected
  std::string silent_reason_ ABSL_GUARDED_BY(mu_);      // why AbortIfIncludes aborted the transport
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_CROSS_NODE_GROUP_H_
