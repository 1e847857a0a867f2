#include "server/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dynamiq::server {

bool LiveSet::IsLive(uint32_t node) const { return epoch == 0 || std::binary_search(live.begin(), live.end(), node); }

uint64_t LiveSet::Generation(uint32_t node) const {
  auto it = std::lower_bound(live.begin(), live.end(), node);
  if (it == live.end() || *it != node) return 0;
  const size_t i = static_cast<size_t>(it - live.begin());
  return i < generations.size() ? generations[i] : 0;
}

std::vector<uint32_t> LiveSet::Silent(const std::vector<uint32_t>& members) const {
  std::vector<uint32_t> out;
  for (uint32_t m : members) {
    if (!IsLive(m)) out.push_back(m);
  }
  return out;
}

std::string LiveSet::DescribeSilent(const std::vector<uint32_t>& nodes) const {
  std::string out = nodes.size() == 1 ? "node " : "nodes ";
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (i > 0) out += ", ";
    absl::StrAppend(&out, nodes[i]);
    for (const auto& [node, seconds] : silent) {
      if (node == nodes[i]) absl::StrAppend(&out, absl::StrFormat(" (silent for %.1f s)", seconds));
    }
  }
  return out;
}

MembershipTracker::MembershipTracker(absl::Duration timeout, uint32_t min_nodes)
    : timeout_(timeout), min_nodes_(min_nodes), created_(absl::Now()) {}

void MembershipTracker::Joined(uint32_t node, absl::Time now) {
  Heard(node, now);
  absl::MutexLock lock(&mu_);
  if (node >= joins_.size()) joins_.resize(node + 1, 0);
  ++joins_[node];
}

void MembershipTracker::Heard(uint32_t node, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (node >= last_heard_.size()) last_heard_.resize(node + 1, absl::InfinitePast());
  last_heard_[node] = std::max(last_heard_[node], now);
}

LiveSet MembershipTracker::Snapshot(uint32_t num_nodes, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (last_heard_.size() < num_nodes) last_heard_.resize(num_nodes, absl::InfinitePast());
  if (joins_.size() < num_nodes) joins_.resize(num_nodes, 0);
  LiveSet set;
  set.min_nodes = min_nodes_;
  for (uint32_t node = 0; node < num_nodes; ++node) {
    const absl::Time heard = std::max(last_heard_[node], created_);
    if (node == 0 || now - heard <= timeout_) {
      set.live.push_back(node);
      set.generations.push_back(joins_[node]);
    } else {
      set.silent.emplace_back(node, absl::ToDoubleSeconds(now - heard));
    }
  }
  if (epoch_ == 0 || set.live != last_live_ || set.generations != last_generations_) {
    ++epoch_;
    last_live_ = set.live;
    last_generations_ = set.generations;
  }
  set.epoch = epoch_;
  return set;
}

}  // namespace dynamiq::server
