// Contributions: what one collective sums and whom it waited for, on this node and, through the
// engine's side lane (engine/side_lane.h), over every node: contribution accounting (the sum of the
// workers' weights and how many contributed) and the straggler view (the local worker that
// submitted last, the node whose part was ready last).
//
// The side lane's layout, the same on every member of a group view of n nodes (server/group_view.h;
// r below is a member's place in the view, its engine rank):
//   [0] the sum of the weights (the number of workers, unweighted)   [1] the workers
//   [2 + r] node r's lateness: seconds from the end of its previous collective until its last
//           local worker submitted this one (0 if that was earlier), so the sums name the node
//           every other node waited for;
//   [2 + n + r] the last collective node r knows a configuration change may apply at (Job's
//           configuration boundary: every node asks the coordinator for changes up to it), so no
//           node needs a round trip to node 0 per collective to find out.
// Each node writes its own slots; the others' are 0 there, so the sums are every node's values.
// The per-node slots only with n <= kMaxLaneNodes.
// A collective carries a side lane when it is weighted, or n <= kMaxLaneNodes and the data path
// has one (DataPath::has_side_lane; GPU nodes have none yet); every node decides alike
// (weighted-ness is part of the collective's id, and a cluster's nodes have the same device).
// Not thread-safe: one per collective, on the reducer thread.
#ifndef DQ_SERVER_CONTRIBUTIONS_H_
#define DQ_SERVER_CONTRIBUTIONS_H_

#include <stdint.h>

#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/side_lane.h"
#include "server/job_observer.h"

namespace dynamiq::server {

class Contributions {
 public:
  // Clusters of up to this many nodes carry every node's slots in the side lane.
  static constexpr uint32_t kMaxLaneNodes = (engine::kMaxSideSums - 2) / 2;

  // `num_nodes` members, this node at place `node_rank` among them. `lateness_lane`: the data path
  // carries a side lane for every collective (the straggler view). `members[r]`: the node rank of
  // place r, which Waits names (empty: the same numbers).
  Contributions(bool weighted, uint32_t num_nodes, uint32_t node_rank, bool lateness_lane = true,
                std::vector<uint32_t> members = {});

  // One local worker's request: its weight (unset: 1) and when it arrived.
  void AddWorker(uint32_t local_rank, std::optional<double> weight, absl::Time arrived);
  // After the last AddWorker: when this node's previous collective ended (unset: this is its first
  // collective, whose lateness says nothing).
  void SetPreviousEnd(std::optional<absl::Time> previous_end);
  // The last collective at which this node knows a configuration change may apply (0: none).
  void SetConfigBoundary(uint64_t sequence);
  // Whether the side lane carries every node's slots (then PollThrough is known after the step).
  bool has_node_slots() const { return has_side_lane_ && side_.size() == 2 + 2 * size_t{num_nodes_}; }
  // After the cross-node step: the last collective any node knows a configuration change may
  // apply at.
  uint64_t ConfigBoundary() const;
  // What the cross-node step carries and sums in place (empty: no side lane).
  absl::Span<double> SideLane();
  // After the cross-node step (or on one node): what was summed.
  double weight_sum() const;
  uint64_t contributors() const;
  // Whom this collective waited for (call after the cross-node step succeeded, or on one node).
  StragglerWait Waits() const;

 private:
  const bool weighted_;
  const uint32_t num_nodes_, node_rank_;
  const std::vector<uint32_t> members_;
  std::vector<double> side_;  // the layout above; [0] and [1] also without a side lane
  bool has_side_lane_;
  std::optional<uint32_t> last_rank_;  // the local worker that arrived last (unset: none added)
  absl::Time first_arrival_ = absl::InfiniteFuture(), last_arrival_ = absl::InfinitePast();
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_CONTRIBUTIONS_H_
