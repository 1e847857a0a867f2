// GroupView: which nodes run a job's collectives, as one node sees it: {view epoch, members, my
// index}, and the first collective it applies to.
//
// A job's cross-node transport connects the view's members only, ranked by their place among the
// members (engine rank = my_index), under rendezvous keys named by the view's epoch and the
// connection's first collective (Cluster::RendezvousPrefix), so a connection is named explicitly
// instead of by a counter every node must advance alike. Epoch 0 is the cluster as it started
// (every node, from collective 0): today's fixed cluster is the view that never changes. A later
// view is claimed by compare-and-set on the coordinator (JobCoordinator::ClaimView: one claimant per
// epoch wins, and every node reads the winner's view), and applies from its first collective on,
// which the claimant takes past every node's current collective (the configuration boundary of
// Job::ReserveConfigBoundary, announced in the side lane), so every member switches at the same
// collective boundary. The mean's denominator, the side lane's layout, the straggler view and the
// bus-bandwidth metric read the view, not the cluster's size.
//
// A value type; cheap to copy.
#ifndef DQ_SERVER_GROUP_VIEW_H_
#define DQ_SERVER_GROUP_VIEW_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dynamiq::server {

class GroupView {
 public:
  // The cluster as it started: nodes 0..num_nodes-1, epoch 0, from collective 0.
  static GroupView Everyone(uint32_t num_nodes, uint32_t node_rank);
  // INVALID_ARGUMENT unless `members` are distinct node ranks below `num_nodes`, at least one.
  // They are kept in ascending order. `node_rank` need not be a member (my_index() is then -1).
  static absl::StatusOr<GroupView> Make(uint64_t epoch, std::vector<uint32_t> members, uint64_t first_sequence,
                                        uint32_t num_nodes, uint32_t node_rank);

  uint64_t epoch() const { return epoch_; }
  const std::vector<uint32_t>& members() const { return members_; }
  uint32_t size() const { return static_cast<uint32_t>(members_.size()); }
  // This node's place among the members (its engine rank), or -1 when it is not one.
  int my_index() const { return my_index_; }
  bool is_member() const { return my_index_ >= 0; }
  uint32_t node_rank() const { return node_rank_; }
  // The first collective the view applies to.
  uint64_t first_sequence() const { return first_sequence_; }
  // The place of node `node` among the members, or -1.
  int IndexOf(uint32_t node) const;

  // "<epoch>|<first sequence>|<m0>,<m1>,..." as the coordinator's store keeps it.
  std::string Encode() const;
  // Encode's inverse, checked like Make (DATA_LOSS naming the text when it does not parse).
  static absl::StatusOr<GroupView> Decode(absl::string_view text, uint32_t num_nodes, uint32_t node_rank);
  // "view 2 (nodes 0, 1 from collective 40)".
  std::string ToString() const;

  friend bool operator==(const GroupView& a, const GroupView& b) {
    return a.epoch_ == b.epoch_ && a.members_ == b.members_ && a.first_sequence_ == b.first_sequence_ &&
           a.node_rank_ == b.node_rank_;
  }

 private:
  uint64_t epoch_ = 0;
  std::vector<uint32_t> members_;
  uint64_t first_sequence_ = 0;
  uint32_t node_rank_ = 0;
  int my_index_ = -1;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_GROUP_VIEW_H_
