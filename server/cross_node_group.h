// CrossNodeGroup: one job's group of nodes as this node sees it: the transport connected through
// the job's coordinator, the generation it was connected at, and the failure causes the nodes
// exchange when the group breaks.
//
// Generations keep the nodes in one group without any extra coordination. Rule: every node advances
// one generation per collective it fails, whether it failed it on its own (its workers disagreed,
// its watchdog fired, a worker left: Decide) or across nodes (a failed exchange: Drop), and connects
// the next collective's transport at the new generation, under fresh rendezvous keys. A node that
// fails a collective on its own publishes why, then aborts the transport (Announce), in that order,
// so a node whose exchange the abort cuts short finds the cause (WithRemoteCause) instead of a bare
// connection reset.
//
// Thread-safe. Connected, Drop and WithRemoteCause are for the job's reducer thread; the others may
// be called from any thread (handlers, the watchdog, Stop).
#ifndef DQ_SERVER_CROSS_NODE_GROUP_H_
#define DQ_SERVER_CROSS_NODE_GROUP_H_

#include <stdint.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/transport.h"
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

  // `coordinator` may be null on one node (there is no group then: Connected fails, and breaks are
  // neither counted nor announced).
  CrossNodeGroup(std::string job_id, uint32_t num_nodes, std::shared_ptr<JobCoordinator> coordinator);

  // The transport for collective `sequence`, connected at the current generation if there is none.
  // A failed connect advances the generation (the collective has failed).
  absl::StatusOr<engine::Transport*> Connected(uint64_t sequence);
  // The group broke during an exchange: drops the transport (aborting it first if `abort`: the peers
  // are still inside the exchange), so the next collective connects at the next generation.
  void Drop(bool abort);
  // Counts `failures` towards the next connection's generation. Call it in the critical section that
  // decides the failures, so that the reducer never runs the next collective in the old group; then
  // Announce, outside any lock.
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
  const std::string job_id_;
  const uint32_t num_nodes_;
  const std::shared_ptr<JobCoordinator> coordinator_;
  absl::Mutex mu_;
  std::unique_ptr<engine::Transport> transport_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pending_generations_ ABSL_GUARDED_BY(mu_) = 0;  // decided breaks, applied at the next connect
  uint64_t transport_serial_ ABSL_GUARDED_BY(mu_) = 0;     // counts the transports connected
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_CROSS_NODE_GROUP_H_
