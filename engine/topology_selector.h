// SelectTopology: the schedule a collective runs under topology=auto, from what every rank knows
// alike (bucket size, group size, codec, transport capabilities), so every rank picks the same
// one without exchanging a word; the step headers carry the pick (ScheduleId) and refuse a rank
// that picked otherwise.
//
// The rule (measurements in docs/design.md, "Algorithms"): ring and butterfly move the same bytes
// in the same n - 1 + n - 1 steps; they differ in how many times a partial sum is re-quantized on
// its way to its owner (n - 1 hops on the ring, log2 n on the butterfly). So:
//   - exact codecs (none) and integer-summing codecs (thc, global_qsgd: the sum is exact whatever
//     the path), and codecs without a butterfly (arc_topk, ...): ring, which holds no fp32
//     accumulators;
//   - re-quantizing codecs (dynamiq, mx*, bf16, uniform, int8) on a power-of-two group of at least
//     kButterflyMinRanks ranks: butterfly, whose shallower trees cut the compression error
//     (docs/codec_real_gradients.md, 8 ranks on real gradients: 1.7-2.1x less error than the ring
//     for DynamiQ 5, 1.6-3.0x for MXFP8); ring below that, where the depths differ by one hop
//     (3 against 2) and the ring measured faster (4 ranks, 64 MiB, emulated 1 Gbit/s
//     cross-continent links: 1.415 s against 1.510 s);
//   - buckets too small to chunk (fewer elements than one super-group per rank): ring.
// Two-shot (engine/schedule.h) runs only where configured: auto does not pick it yet (its place,
// small buckets where two steps beat 2 (n - 1), waits for a measured table, issue #39).
// Transport capabilities do not change the pick today (every reliable transport, the only kind the
// engine runs over, carries every schedule; the datagram transport `udp` runs none yet); they are
// part of the question so that a transport that cannot is answered here and nowhere else.
#ifndef DQ_ENGINE_TOPOLOGY_SELECTOR_H_
#define DQ_ENGINE_TOPOLOGY_SELECTOR_H_

#include <stddef.h>

#include "engine/schedule.h"
#include "engine/transport.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

inline constexpr int kButterflyMinRanks = 8;

// `topology` as configured: kRing, kButterfly and kTwoShot are returned as they are; kAuto is
// resolved (to the ring or the butterfly).
Topology SelectTopology(Topology topology, size_t num_elements, int world_size, const kernels::Codec& codec,
                        const TransportCapabilities& transport);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_TOPOLOGY_SELECTOR_H_
