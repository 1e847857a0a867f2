#include "engine/schedule.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::engine {
namespace {

int Mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

absl::string_view TopologyName(Topology t) {
  switch (t) {
    case Topology::kRing:
      return "ring";
    case Topology::kButterfly:
      return "butterfly";
    case Topology::kTwoShot:
      return "two_shot";
    case Topology::kAuto:
      return "auto";
  }
  return "unknown";
}

absl::StatusOr<Topology> ParseTopology(absl::string_view name) {
  if (name == "ring") return Topology::kRing;
  if (name == "butterfly") return Topology::kButterfly;
  if (name == "two_shot") return Topology::kTwoShot;
  if (name == "auto") return Topology::kAuto;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown topology '", name, "' (expected ring, butterfly, two_shot or auto)"));
}

uint8_t ScheduleId(Topology t) {
  switch (t) {
    case Topology::kButterfly:
      return 1;
    case Topology::kTwoShot:
      return 2;
    case Topology::kRing:
    case Topology::kAuto:  // resolved before anything is sent
      break;
  }
  return 0;
}

absl::StatusOr<Schedule> MakeSchedule(Topology topology, int n) {
  if (n < 1 || n > 65535) return absl::InvalidArgumentError(absl::StrCat("world size must be 1..65535, got ", n));
  if (topology == Topology::kAuto) {
    return absl::InvalidArgumentError("topology auto is resolved per collective (SelectTopology) before a schedule");
  }
  if (topology == Topology::kButterfly && (n & (n - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("butterfly needs a power-of-two world size, got ", n));
  }
  Schedule s;
  s.topology = topology;
  s.world_size = n;
  s.owner.resize(n);
  for (int c = 0; c < n; ++c) s.owner[c] = Mod(c - 1, n);
  if (topology == Topology::kTwoShot) {
    // Round i of each step: every rank to the rank i after it (that rank's chunk, then its own
    // final bytes), so each rank's receives are listed in the order their senders send them.
    std::vector<Transfer> rs, ag;
    for (int i = 1; i < n; ++i) {
      for (int r = 0; r < n; ++r) {
        const int to = Mod(r + i, n);
        rs.push_back({r, to, Mod(to + 1, n)});
        ag.push_back({r, to, Mod(r + 1, n)});
      }
    }
    if (n > 1) {
      s.reduce_scatter.push_back(std::move(rs));
      s.all_gather.push_back(std::move(ag));
    }
  } else {
    if (topology == Topology::kRing) {
      for (int step = 0; step + 1 < n; ++step) {
        std::vector<Transfer> t;
        for (int r = 0; r < n; ++r) t.push_back({r, Mod(r + 1, n), Mod(r - step, n)});
        s.reduce_scatter.push_back(std::move(t));
      }
    } else {
      for (int span = 2; span <= n; span *= 2) {
        for (int base = 0; base < n; base += span) {
          const int a = base + span / 2 - 1, b = base + span - 1;
          std::vector<Transfer> t;
          for (int r = 0; r < n; ++r) t.push_back({r, Mod(r - a + b, n), Mod(r - a, n)});
          s.reduce_scatter.push_back(std::move(t));
        }
      }
    }
    for (int step = 0; step + 1 < n; ++step) {
      std::vector<Transfer> t;
      for (int r = 0; r < n; ++r) t.push_back({r, Mod(r + 1, n), Mod(r + 1 - step, n)});
      s.all_gather.push_back(std::move(t));
    }
  }
  // Every schedule an engine runs comes from here, checked once where it is made.
  DQ_RETURN_IF_ERROR(ValidateSchedule(s));
  return s;
}

absl::Status ValidateSchedule(const Schedule& s, StepLimits limits) {
  const int n = s.world_size;
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat(TopologyName(s.topology), " schedule for ", n, " ranks: ", parts...));
  };
  if (n < 1) return invalid("no ranks");
  if (s.owner.size() != static_cast<size_t>(n)) return invalid(s.owner.size(), " chunk owners, expected one per rank");
  std::vector<int> owns(n, 0);
  for (int c = 0; c < n; ++c) {
    if (s.owner[c] < 0 || s.owner[c] >= n) return invalid("chunk ", c, "'s owner ", s.owner[c], " is out of range");
    if (++owns[s.owner[c]] > 1) return invalid("rank ", s.owner[c], " owns more than one chunk");
  }
  // Per chunk and rank: the step at which the rank last got the chunk (a child's partial sum in the
  // reduce-scatter, the final bytes in the all-gather); -1 never.
  auto check_step = [&](absl::string_view phase, size_t index, const std::vector<Transfer>& step) -> absl::Status {
    std::vector<int> sends(n, 0), receives(n, 0);
    std::set<std::pair<int, int>> links;
    for (const Transfer& t : step) {
      if (t.from < 0 || t.from >= n || t.to < 0 || t.to >= n || t.chunk < 0 || t.chunk >= n) {
        return invalid(phase, " step ", index, ": transfer ", t.from, " -> ", t.to, " of chunk ", t.chunk,
                       " is out of range");
      }
      if (t.from == t.to) return invalid(phase, " step ", index, ": rank ", t.from, " sends to itself");
      if (!links.emplace(t.from, t.to).second) {
        return invalid(phase, " step ", index, ": rank ", t.from, " sends to rank ", t.to, " twice");
      }
      if (++sends[t.from] > limits.sends) {
        return invalid(phase, " step ", index, ": rank ", t.from, " sends more than ", limits.sends, " message(s)");
      }
      if (++receives[t.to] > limits.receives) {
        return invalid(phase, " step ", index, ": rank ", t.to, " receives more than ", limits.receives, " message(s)");
      }
    }
    return absl::OkStatus();
  };
  // Reduce-scatter: sent[c][r] the step rank r sent chunk c (-1 not yet); last_in[c][r] the last step
  // at which a child's partial sum of chunk c reached r.
  std::vector<std::vector<int>> sent(n, std::vector<int>(n, -1)), last_in(n, std::vector<int>(n, -1));
  for (size_t k = 0; k < s.reduce_scatter.size(); ++k) {
    DQ_RETURN_IF_ERROR(check_step("reduce-scatter", k, s.reduce_scatter[k]));
    const int step = static_cast<int>(k);
    for (const Transfer& t : s.reduce_scatter[k]) {
      if (t.from == s.owner[t.chunk])
        return invalid("reduce-scatter step ", k, ": chunk ", t.chunk, "'s owner ", t.from, " sends it");
      if (sent[t.chunk][t.from] >= 0) {
        return invalid("reduce-scatter step ", k, ": rank ", t.from, " sends chunk ", t.chunk,
                       " a second time (first at step ", sent[t.chunk][t.from], ")");
      }
      if (sent[t.chunk][t.to] >= 0) {
        return invalid("reduce-scatter step ", k, ": rank ", t.to, " receives chunk ", t.chunk,
                       " after it sent its partial sum at step ", sent[t.chunk][t.to]);
      }
      sent[t.chunk][t.from] = step;
    }
    // Receives of this step count only for later steps: a rank cannot forward in the step it receives.
    for (const Transfer& t : s.reduce_scatter[k]) last_in[t.chunk][t.to] = step;
    for (const Transfer& t : s.reduce_scatter[k]) {
      if (last_in[t.chunk][t.from] == step) {
        return invalid("reduce-scatter step ", k, ": rank ", t.from, " sends chunk ", t.chunk,
                       " in the step it still receives a part of it");
      }
    }
  }
  for (int c = 0; c < n; ++c) {
    for (int r = 0; r < n; ++r) {
      if (r != s.owner[c] && sent[c][r] < 0) return invalid("rank ", r, "'s part of chunk ", c, " never leaves it");
    }
  }
  // All-gather: have[c][r] the step from which rank r holds chunk c's final bytes.
  std::vector<std::vector<int>> have(n, std::vector<int>(n, -1));
  for (int c = 0; c < n; ++c) have[c][s.owner[c]] = 0;
  for (size_t k = 0; k < s.all_gather.size(); ++k) {
    DQ_RETURN_IF_ERROR(check_step("all-gather", k, s.all_gather[k]));
    const int step = static_cast<int>(k);
    for (const Transfer& t : s.all_gather[k]) {
      if (have[t.chunk][t.from] < 0 || have[t.chunk][t.from] > step) {
        return invalid("all-gather step ", k, ": rank ", t.from, " forwards chunk ", t.chunk,
                       " before it holds the final bytes");
      }
      if (have[t.chunk][t.to] >= 0) {
        return invalid("all-gather step ", k, ": rank ", t.to, " receives chunk ", t.chunk, " a second time");
      }
    }
    for (const Transfer& t : s.all_gather[k]) have[t.chunk][t.to] = step + 1;
  }
  for (int c = 0; c < n; ++c) {
    for (int r = 0; r < n; ++r) {
      if (have[c][r] < 0) return invalid("rank ", r, " never receives chunk ", c, "'s result");
    }
  }
  return absl::OkStatus();
}

kernels::ChunkRef ChunkOf(size_t d, int n, int c) {
  const size_t sg = kernels::kSuperGroupSize;
  size_t len = (d + n - 1) / n;
  len = (len + sg - 1) / sg * sg;
  const size_t begin = std::min(d, static_cast<size_t>(c) * len);
  const size_t end = std::min(d, begin + len);
  return kernels::ChunkRef{static_cast<uint32_t>(c), begin, end - begin};
}

kernels::ChunkRef SiblingRef(const Schedule& schedule, const kernels::ChunkRef& elements, int chunk, int rank,
                             int peer) {
  std::vector<int> siblings;
  for (const auto& step : schedule.reduce_scatter) {
    for (const Transfer& t : step) {
      if (t.chunk == chunk && t.to == peer) siblings.push_back(t.from);
    }
  }
  kernels::ChunkRef ref = elements;
  ref.rounding_size = static_cast<uint32_t>(siblings.size());
  ref.rounding_index = static_cast<uint32_t>(std::find(siblings.begin(), siblings.end(), rank) - siblings.begin());
  ref.rounding_group =
      static_cast<uint32_t>(chunk) * static_cast<uint32_t>(schedule.world_size) + static_cast<uint32_t>(peer);
  return ref;
}

}  // namespace dynamiq::engine
