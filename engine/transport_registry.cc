#include "engine/transport_registry.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dynamiq::engine {
namespace {

TransportKind Kind(absl::string_view name, bool device_memory, bool scatter_gather, bool host_selectable,
                   absl::string_view summary) {
  TransportKind k;
  k.capabilities.kind = std::string(name);
  k.capabilities.device_memory = device_memory;
  k.capabilities.scatter_gather = scatter_gather;
  k.host_selectable = host_selectable;
  k.summary = summary;
  return k;
}

TransportKind DatagramKind(absl::string_view name, absl::string_view summary) {
  TransportKind k = Kind(name, false, false, false, summary);
  k.capabilities.reliable = false;
  k.capabilities.ordered = false;
  k.datagram = true;
  return k;
}

const std::vector<TransportKind>& Registry() {
  static const auto* kinds = new std::vector<TransportKind>{
      Kind("tcp", false, true, true, "dynamiq's own TCP transport: one connection per peer, scatter/gather"),
      Kind("gloo", false, false, true, "Gloo's TCP pairs"),
      Kind("nccl", true, false, false, "NCCL point-to-point between GPUs (--device=cuda)"),
      Kind("memory", false, true, false, "ranks as threads of one process (tests, the simulator's oracle)"),
      DatagramKind("udp", "authenticated UDP datagrams, sent once (engine/udp_transport.h)"),
  };
  return *kinds;
}

}  // namespace

absl::Span<const TransportKind> TransportKinds() { return Registry(); }

absl::StatusOr<TransportKind> FindTransportKind(absl::string_view name) {
  std::vector<std::string> names;
  for (const TransportKind& k : Registry()) {
    if (k.capabilities.kind == name) return k;
    names.push_back(k.capabilities.kind);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown transport '", name, "' (registered: ", absl::StrJoin(names, ", "), ")"));
}

std::string HostTransportNames() {
  std::vector<std::string> names;
  for (const TransportKind& k : Registry()) {
    if (k.host_selectable) names.push_back(k.capabilities.kind);
  }
  return absl::StrJoin(names, " or ");
}

}  // namespace dynamiq::engine
