#include "server/contributions.h"

#include <algorithm>
#include <utility>

namespace dynamiq::server {

Contributions::Contributions(bool weighted, uint32_t num_nodes, uint32_t node_rank, bool lateness_lane,
                             std::vector<uint32_t> members)
    : weighted_(weighted),
      num_nodes_(num_nodes),
      node_rank_(node_rank),
      members_(std::move(members)),
      has_side_lane_(num_nodes > 1 && (weighted || (lateness_lane && num_nodes <= kMaxLaneNodes))) {
  side_.assign(lateness_lane && num_nodes <= kMaxLaneNodes ? 2 + 2 * size_t{num_nodes} : 2, 0.0);
}

void Contributions::AddWorker(uint32_t local_rank, std::optional<double> weight, absl::Time arrived) {
  side_[0] += weight.value_or(1.0);
  side_[1] += 1;
  first_arrival_ = std::min(first_arrival_, arrived);
  if (arrived >= last_arrival_) {
    last_arrival_ = arrived;
    last_rank_ = local_rank;
  }
}

void Contributions::SetPreviousEnd(std::optional<absl::Time> previous_end) {
  if (!has_node_slots()) return;
  // A node without a previous collective says so with -1: the sum then tells every node.
  side_[2 + node_rank_] =
      previous_end.has_value() ? std::max(0.0, absl::ToDoubleSeconds(last_arrival_ - *previous_end)) : -1.0;
}

void Contributions::SetConfigBoundary(uint64_t sequence) {
  if (has_node_slots()) side_[2 + num_nodes_ + node_rank_] = static_cast<double>(sequence);
}

uint64_t Contributions::ConfigBoundary() const {
  double last = 0;
  if (has_node_slots()) {
    for (uint32_t r = 0; r < num_nodes_; ++r) last = std::max(last, side_[2 + num_nodes_ + r]);
  }
  return static_cast<uint64_t>(last);
}

absl::Span<double> Contributions::SideLane() { return has_side_lane_ ? absl::MakeSpan(side_) : absl::Span<double>(); }

// Without a side lane (one node, or a large unweighted cluster) every node has as many workers.
uint64_t Contributions::contributors() const {
  return static_cast<uint64_t>(side_[1]) * (has_side_lane_ ? 1 : num_nodes_);
}

double Contributions::weight_sum() const { return weighted_ ? side_[0] : static_cast<double>(contributors()); }

StragglerWait Contributions::Waits() const {
  StragglerWait wait;
  if (last_rank_.has_value()) {
    wait.local_rank = last_rank_;
    wait.local_seconds = absl::ToDoubleSeconds(last_arrival_ - first_arrival_);
  }
  if (!has_node_slots()) return wait;
  uint32_t slowest = 0;
  for (uint32_t r = 0; r < num_nodes_; ++r) {
    if (side_[2 + r] < 0) return wait;  // a node's first collective: nothing to compare
    if (side_[2 + r] > side_[2 + slowest]) slowest = r;
  }
  wait.node = slowest < members_.size() ? members_[slowest] : slowest;
  wait.node_seconds = side_[2 + slowest] - side_[2 + node_rank_];
  return wait;
}

}  // namespace dynamiq::server
