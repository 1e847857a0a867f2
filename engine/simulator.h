// In-process simulation of a compressed multi-hop all-reduce over n ranks: every rank runs a
// RankExecutor over the real Schedule, and messages are byte vectors handed over in step order.
// It measures compression error and wire bytes before any network exists, and is the oracle the
// network engines are tested against (same schedule, same bytes).
#ifndef DQ_ENGINE_SIMULATOR_H_
#define DQ_ENGINE_SIMULATOR_H_

#include <stdint.h>

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/schedule.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

struct SimulationResult {
  std::vector<uint64_t> bytes_sent;  // per rank: statistics exchange + reduce-scatter + all-gather
  uint64_t stats_bytes_sent = 0;     // all ranks, statistics exchange only
  uint64_t total_bytes_sent = 0;     // all ranks
  std::vector<uint8_t> widths;       // DynamiQ: rank 0's code width per super-group (for analysis)
};

// All-reduces inputs[r] (num_elements values each) into outputs[r] for every rank r.
// inputs/outputs have one entry per rank; Source::subtract_per_group and Dest::add_per_group
// must be unset (the codec's plan supplies them). A codec that NeedsBucketTransform (THC) runs on
// every rank's transformed bucket (keyed by `round`), and the sums are transformed back, as the
// engine does (kernels/cpu/bucket_transform.h).
absl::StatusOr<SimulationResult> SimulateAllReduce(const kernels::Codec& codec, const Schedule& schedule,
                                                   size_t num_elements, uint64_t round,
                                                   absl::Span<const kernels::Source> inputs,
                                                   absl::Span<const kernels::Dest> outputs);

// The same with a DynamiQ b̄ per hop (engine/hop_budget.h; a simulation study, the engines have
// none): hop_bits[k - 1] is the b̄ (RoundInfo::bits) of every compression of a partial sum of k
// contributions, k = n being the owner's final sum that the all-gather forwards. Not fused: a
// receiver decodes with the plan of the sender's b̄, adds into an fp32 partial sum and compresses
// that at its own (with one b̄ everywhere: the values of SimulateAllReduce, bit for bit). Every
// b̄ must be one the codec's MakePlan takes in RoundInfo::bits.
absl::StatusOr<SimulationResult> SimulateAllReduceHopBits(const kernels::Codec& codec, const Schedule& schedule,
                                                          size_t num_elements, uint64_t round,
                                                          absl::Span<const double> hop_bits,
                                                          absl::Span<const kernels::Source> inputs,
                                                          absl::Span<const kernels::Dest> outputs);

// Bits per coordinate per message: total bytes sent / (num_elements * 2 (n-1)); for n == 1 the
// bits of the one compressed chunk per coordinate. Comparable to a codec's nominal bits.
double WireBitsPerCoord(const SimulationResult& result, size_t num_elements, int world_size);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_SIMULATOR_H_
