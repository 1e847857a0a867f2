#include "engine/topology_selector.h"

#include "kernels/dynamiq_math.h"

namespace dynamiq::engine {
namespace {

// Whether a partial sum loses precision at every hop it is re-encoded (the deeper the tree, the
// larger the error); exact and integer-summing codecs do not.
bool RequantizesPerHop(kernels::CodecId id) {
  switch (id) {
    case kernels::CodecId::kNone:
    case kernels::CodecId::kThc:
    case kernels::CodecId::kGlobalQsgd:
    case kernels::CodecId::kArcTopK:
      return false;
    default:
      return true;
  }
}

}  // namespace

Topology SelectTopology(Topology topology, size_t num_elements, int n, const kernels::Codec& codec,
                        const TransportCapabilities& transport) {
  if (topology != Topology::kAuto) return topology;
  const bool power_of_two = n > 0 && (n & (n - 1)) == 0;
  const bool chunked = num_elements >= static_cast<size_t>(n) * kernels::kSuperGroupSize;
  if (power_of_two && n >= kButterflyMinRanks && chunked && transport.reliable && codec.SupportsButterfly() &&
      RequantizesPerHop(codec.id())) {
    return Topology::kButterfly;
  }
  return Topology::kRing;
}

}  // namespace dynamiq::engine
