// SideLane: the exact fp64 sums a collective carries beside its data (AllReduceOptions::side_sums),
// for contribution accounting: the sum of the contributors' weights, how many contributed. The
// data's sum may be compressed; these sums never are.
//
// A direct exchange in one round, started before the statistics and finished after the all-gather,
// so its messages travel while the data does and add no dependent step: every rank sends its k
// values to every other rank, and every rank adds the
// n contributions in rank order, so the sums are bit-identical on every rank. k is small (a few
// values), so the n - 1 messages per rank are headers and a few bytes each. The message from rank q
// to rank p is (kSideLane, step q, block p): unique among the collective's messages.
// Not thread-safe; one per collective.
#ifndef DQ_ENGINE_SIDE_LANE_H_
#define DQ_ENGINE_SIDE_LANE_H_

#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/step_messenger.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

// At most this many side values per collective (a side lane is for a few scalars).
inline constexpr size_t kMaxSideSums = 32;

// IEEE-754 binary64, little-endian, 8 bytes per value.
std::vector<uint8_t> EncodeSideSums(absl::Span<const double> values);
// INVALID_ARGUMENT when `bytes` is not out.size() values.
absl::Status DecodeSideSums(absl::Span<const uint8_t> bytes, absl::Span<double> out);

class SideLane {
 public:
  // `codec` names the messages in their headers (the collective's codec).
  SideLane(const kernels::Codec& codec, int rank, int n) : codec_(codec), rank_(rank), n_(n) {}

  // Posts the receives of every other rank's values and sends this rank's `values` to each.
  // INVALID_ARGUMENT for more than kMaxSideSums values.
  absl::Status Start(StepMessenger& messenger, absl::Span<const double> values);
  // Receives the other ranks' values and writes the sums over all ranks, in rank order, into
  // `sums` (as many as Start's values). A rank that sent another number of values fails it with
  // INVALID_ARGUMENT naming that rank and both counts.
  absl::Status Finish(StepMessenger& messenger, absl::Span<double> sums);

 private:
  uint32_t Me() const { return static_cast<uint32_t>(rank_); }

  const kernels::Codec& codec_;
  const int rank_, n_;
  std::vector<uint8_t> mine_;  // sent to every other rank; valid until Finish waited for the sends
  std::vector<double> values_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_SIDE_LANE_H_
