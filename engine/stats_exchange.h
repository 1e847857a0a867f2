// The statistics all-reduce of codecs whose statistics are sums (DynamiQ), shared by
// engine::AllReduce, the NCCL program and the simulator so that all three reduce bit-identically.
//
// A direct exchange in two rounds instead of a ring: the statistics are small (2 values per 256
// elements), so their all-reduce is bound by latency, and a ring has 2(n-1) dependent hops where
// this has two, with the same bytes per rank (scripts/bench-network, 64 MiB: no difference at 4
// ranks, where computing the statistics dominates; 0.216 vs 0.222 s at 8 ranks):
//   1. every rank sends chunk p of its statistics (ChunkOf(length, n, p)), rounded to bf16, to
//      rank p;
//   2. rank p sums the n contributions to its chunk in rank order in fp32, rounds the sum to bf16
//      (SumStatsBf16) and sends it to every rank.
// Every rank decodes the same bf16 bytes, so the reduced statistics are identical everywhere.
#ifndef DQ_ENGINE_STATS_EXCHANGE_H_
#define DQ_ENGINE_STATS_EXCHANGE_H_

#include <stdint.h>

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dynamiq::engine {

// bf16 (round to nearest even), little-endian, 2 bytes per value.
std::vector<uint8_t> EncodeStatsBf16(absl::Span<const float> values);

// The bf16 sum of the contributions, contributions[r] from rank r, added in rank order in fp32.
// INVALID_ARGUMENT, naming the rank, when a contribution's size differs from `expected_bytes`.
absl::StatusOr<std::vector<uint8_t>> SumStatsBf16(absl::Span<const absl::Span<const uint8_t>> contributions,
                                                  size_t expected_bytes);

// Decodes bf16 bytes into `out`; INVALID_ARGUMENT when the sizes do not match.
absl::Status DecodeStatsBf16(absl::Span<const uint8_t> bytes, absl::Span<float> out);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_STATS_EXCHANGE_H_
