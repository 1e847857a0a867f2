#include "engine/schedule.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::engine {
namespace {

int Mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

absl::string_view TopologyName(Topology t) { return t == Topology::kRing ? "ring" : "butterfly"; }

absl::StatusOr<Topology> ParseTopology(absl::string_view name) {
  if (name == "ring") return Topology::kRing;
  if (name == "butterfly") return Topology::kButterfly;
  return absl::InvalidArgumentError(absl::StrCat("unknown topology '", name, "' (expected ring or butterfly)"));
}

absl::StatusOr<Schedule> MakeSchedule(Topology topology, int n) {
  if (n < 1 || n > 65535) return absl::InvalidArgumentError(absl::StrCat("world size must be 1..65535, got ", n));
  if (topology == Topology::kButterfly && (n & (n - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("butterfly needs a power-of-two world size, got ", n));
  }
  Schedule s;
  s.topology = topology;
  s.world_size = n;
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
  s.owner.resize(n);
  for (int c = 0; c < n; ++c) s.owner[c] = Mod(c - 1, n);
  return s;
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
