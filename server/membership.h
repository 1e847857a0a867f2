// Membership: which nodes of a cluster are alive, as the coordinator (node 0) learns it from their
// heartbeats, and what a node does with it (docs/design.md, "Membership").
//
// Every node heartbeats to the coordinator every quarter of --heartbeat_timeout (node 0 too, over
// the same RPC). A node the coordinator has not heard from (a heartbeat or a join) for longer than
// the timeout is silent: killed, cut off, or stopped. The coordinator answers every heartbeat with
// the live set, numbered by an epoch that changes whenever the set does, and its --min_nodes.
// What a node does with a live set that leaves out a member of a job's group view (server/job.h,
// Job::OnMembership): it aborts the job's transport (an exchange waiting on the silent node fails
// at once), and the view's lowest live member claims the next view without the silent nodes, from
// the first collective it has not completed, as long as at least min_nodes remain; below that the
// job's collectives fail with FAILED_PRECONDITION naming the silent nodes.
//
// The coordinator itself is a single point (as PCCL's master): a silent node 0 is not detected here
// (the other nodes' calls fail with UNAVAILABLE, and a restarted coordinator is re-joined,
// server/daemon.cc).
#ifndef DQ_SERVER_MEMBERSHIP_H_
#define DQ_SERVER_MEMBERSHIP_H_

#include <stdint.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dynamiq::server {

// The coordinator's answer to a heartbeat. Epoch 0 (no answer yet, or a coordinator without
// heartbeats) counts every node as live.
struct LiveSet {
  uint64_t epoch = 0;
  std::vector<uint32_t> live;                       // ascending
  uint32_t min_nodes = 0;                           // node 0's --min_nodes (0: every node of the cluster)
  std::vector<std::pair<uint32_t, double>> silent;  // node rank, seconds since last heard from
  // Parallel to `live`: how many times each node has joined the cluster. A node whose count moved
  // on restarted (a new dynamiqd in its place), whether or not it went silent in between.
  std::vector<uint64_t> generations;

  bool IsLive(uint32_t node) const;
  // How many times `node` has joined (0: unknown, or not live).
  uint64_t Generation(uint32_t node) const;
  // `members` that are not live.
  std::vector<uint32_t> Silent(const std::vector<uint32_t>& members) const;
  // "node 3 (silent for 2.1 s)", "nodes 1 (silent for 2.0 s), 3 (silent for 2.4 s)".
  std::string DescribeSilent(const std::vector<uint32_t>& nodes) const;
};

// The coordinator's side: when it last heard from each node, and the live set that follows.
// Thread-safe.
class MembershipTracker {
 public:
  // `timeout` > 0. `min_nodes`: reported in every live set (0: every node).
  MembershipTracker(absl::Duration timeout, uint32_t min_nodes);

  // A join (a dynamiqd taking the node's place, the first or a restarted one) or a heartbeat from
  // `node` at `now`.
  void Joined(uint32_t node, absl::Time now);
  void Heard(uint32_t node, absl::Time now);
  // The live set of a cluster of `num_nodes` at `now`: node 0 and the nodes heard from within the
  // timeout (a node never heard from counts from the tracker's creation). The epoch moves on
  // whenever the set, or a live node's generation, differs from the last one returned.
  LiveSet Snapshot(uint32_t num_nodes, absl::Time now);

 private:
  const absl::Duration timeout_;
  const uint32_t min_nodes_;
  const absl::Time created_;
  absl::Mutex mu_;
  std::vector<absl::Time> last_heard_ ABSL_GUARDED_BY(mu_);  // by node rank; InfinitePast: never
  std::vector<uint64_t> joins_ ABSL_GUARDED_BY(mu_);         // by node rank
  std::vector<uint32_t> last_live_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> last_generations_ ABSL_GUARDED_BY(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_MEMBERSHIP_H_
