#include "server/group_view.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace dynamiq::server {

GroupView GroupView::Everyone(uint32_t num_nodes, uint32_t node_rank) {
  GroupView view;
  for (uint32_t r = 0; r < num_nodes; ++r) view.members_.push_back(r);
  view.node_rank_ = node_rank;
  view.my_index_ = view.IndexOf(node_rank);
  return view;
}

absl::StatusOr<GroupView> GroupView::Make(uint64_t epoch, std::vector<uint32_t> members, uint64_t first_sequence,
                                          uint32_t num_nodes, uint32_t node_rank) {
  if (members.empty()) return absl::InvalidArgumentError(absl::StrCat("view ", epoch, " has no members"));
  std::sort(members.begin(), members.end());
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] >= num_nodes) {
      return absl::InvalidArgumentError(
          absl::StrCat("view ", epoch, ": node ", members[i], " is not a node of this cluster of ", num_nodes));
    }
    if (i > 0 && members[i] == members[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("view ", epoch, ": node ", members[i], " is named twice"));
    }
  }
  GroupView view;
  view.epoch_ = epoch;
  view.members_ = std::move(members);
  view.first_sequence_ = first_sequence;
  view.node_rank_ = node_rank;
  view.my_index_ = view.IndexOf(node_rank);
  return view;
}

int GroupView::IndexOf(uint32_t node) const {
  auto it = std::lower_bound(members_.begin(), members_.end(), node);
  return it != members_.end() && *it == node ? static_cast<int>(it - members_.begin()) : -1;
}

std::string GroupView::Encode() const {
  return absl::StrCat(epoch_, "|", first_sequence_, "|", absl::StrJoin(members_, ","));
}

absl::StatusOr<GroupView> GroupView::Decode(absl::string_view text, uint32_t num_nodes, uint32_t node_rank) {
  std::vector<absl::string_view> fields = absl::StrSplit(text, '|');
  uint64_t epoch = 0, first = 0;
  std::vector<uint32_t> members;
  bool ok = fields.size() == 3 && absl::SimpleAtoi(fields[0], &epoch) && absl::SimpleAtoi(fields[1], &first);
  if (ok) {
    for (absl::string_view m : absl::StrSplit(fields[2], ',')) {
      uint32_t node = 0;
      if (!absl::SimpleAtoi(m, &node)) {
        ok = false;
        break;
      }
      members.push_back(node);
    }
  }
  if (!ok) return absl::DataLossError(absl::StrCat("a group view that does not parse: '", absl::CHexEscape(text), "'"));
  absl::StatusOr<GroupView> view = Make(epoch, std::move(members), first, num_nodes, node_rank);
  if (!view.ok()) return absl::DataLossError(view.status().message());
  return view;
}

std::string GroupView::ToString() const {
  return absl::StrCat("view ", epoch_, " (node", members_.size() == 1 ? " " : "s ", absl::StrJoin(members_, ", "),
                      " from collective ", first_sequence_, ")");
}

}  // namespace dynamiq::server
