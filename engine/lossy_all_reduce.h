// LossyAllReduceMean: the loss-tolerant all-reduce of issue #36 over a DatagramTransport (engine/
// datagram_transport.h): the group's mean of a float vector, where every phase ends at a deadline
// with what arrived instead of waiting for every byte.
//
// Schedule: one hop each way, not a ring. A ring's partial sums lose every contribution folded into
// a lost packet (a hop-k loss drops k of them) and every hop waits for the one before; a one-hop
// all-to-all reduce-scatter loses exactly the contributions whose datagrams were lost, and both
// phases take one deadline each whatever the group size.
//   1. Reduce-scatter: the vector is cut into one chunk per rank (rank c owns elements
//      [N c / n, N (c + 1) / n)); every rank sends its values of chunk c to rank c in datagrams
//      (slices of at most what one datagram carries). The owner adds its own values and each slice
//      that arrived by the first deadline, counting per slice the contributions that arrived (its
//      own always among them), and divides by that count: an unbiased estimate of the mean when
//      losses do not depend on the values (`normalize` false divides by the group size instead,
//      biased low under loss: what the tests use to show they can see bias).
//   2. All-gather: every owner sends its chunk's means to every rank (with each slice's count).
//      The second deadline is phase_timeout after this rank's sends, and never earlier than twice
//      phase_timeout after its first phase's sends: an owner that missed a contribution sends
//      its means only at its first deadline, and a rank that had everything early must still be
//      waiting for them then (otherwise one lost datagram costs a whole chunk, by a race).
//      Slices that did not arrive by the second deadline keep the receiver's own values (its input),
//      which the caller's periodic reliable resync (dynamiq::SyncState) brings back in line.
// A datagram's payload: [u64 first element][u32 count][u32 contributors][u64 announcement][count
// values], all little-endian, the values (LossyAllReduceOptions::values) f32, bf16 (half the bytes)
// or int8 ([f32 scale][count int8 codes], the slice's largest magnitude / 127, codes rounded to
// nearest: a quarter of the bytes, decodable on its own). Every contribution counts as its datagram
// carries it, the owner's own included, and an owner keeps its means as it sends them, so the
// ranks' results agree bit for bit when nothing is lost; the transport authenticates it and carries the phase in its
// tag (2 sequence + 0 or 1). Payloads that do not fit (wrong length, an element range outside the owner's chunk or not
// on the slicing, a slice already counted from that rank) are dropped and counted, never used.
//
// Thread-compatible: one call at a time per transport (it sets the transport's accepted tags).
#ifndef DQ_ENGINE_LOSSY_ALL_REDUCE_H_
#define DQ_ENGINE_LOSSY_ALL_REDUCE_H_

#include <stddef.h>
#include <stdint.h>

#include <vector>

#include <optional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/datagram_transport.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

// f32; bf16 (round to nearest even); int8 with one f32 scale per datagram.
enum class LossyValues { kFp32, kBf16, kInt8 };
// How a job's codec travels in the loss-tolerant all-reduce: none as f32, bf16 as bf16, int8 as
// int8 with a scale per datagram (not INTELLECT-1's ±6 sigma clip per chunk: a datagram must
// decode on its own); nullopt for the codecs whose datagrams could not (DynamiQ, MX, THC, ...).
std::optional<LossyValues> LossyValuesOf(kernels::CodecId codec);

struct LossyAllReduceOptions {
  // Identical on every rank and distinct per collective: the datagrams' tags (2 sequence, 2
  // sequence + 1), so a late datagram of another collective is never counted in this one.
  uint64_t sequence = 0;
  // How long each phase waits after this rank's sends (it takes what arrives while it sends, too;
  // the second at least until twice this after the first phase's sends, see above):
  // the call returns within twice this plus the time its sends take (their bytes at
  // `send_bytes_per_second`), earlier when everything arrived. Sends that take long on a busy CPU
  // do not eat into the wait.
  absl::Duration phase_timeout = absl::Milliseconds(100);
  // Owners divide by the contributions that arrived (unbiased); false: by the group size.
  bool normalize = true;
  // Bytes per second this rank sends at most (datagram payloads; 0: as fast as the socket takes
  // them). Without congestion control, datagrams sent faster than the path's bottleneck are lost in
  // its queue: pace at the link's share (a phase sends (n - 1) / n of the vector per rank), and
  // give each phase the time its bytes take at that rate.
  double send_bytes_per_second = 0;
  // How values travel (the same on every rank).
  LossyValues values = LossyValues::kFp32;
  // A number every datagram of this rank carries (the daemon: the last collective at which it
  // knows a configuration change may apply), so the others learn it from any one that arrives.
  uint64_t announcement = 0;
};

struct LossyAllReduceResult {
  // Reduce-scatter: contributions (slices from other ranks) to this rank's chunk that arrived, of
  // those expected. All-gather: slices of the other owners' chunks that arrived, of those expected.
  uint64_t contributions_arrived = 0, contributions_expected = 0;
  uint64_t gathered_arrived = 0, gathered_expected = 0;
  // Datagrams dropped by this call (malformed, out of range, or a repeat of a counted slice), and
  // sends the transport refused (a full socket buffer: counted as lost).
  uint64_t rejected = 0;
  uint64_t send_failures = 0;
  // Payload bytes of the datagrams this rank sent (refused sends not counted).
  uint64_t bytes_sent = 0;
  // Contributions to this rank's chunk that arrived after its first deadline (not used).
  uint64_t late = 0;
  // Per rank: the datagrams this rank expected from it (its contributions to this rank's chunk and
  // its chunk's means) and those that arrived in time (0 for this rank itself).
  std::vector<uint64_t> expected_from, arrived_from;
  // Elements of the output that kept this rank's own values (all-gather slices that did not arrive).
  uint64_t kept_own_elements = 0;
  // The other ranks from which at least one intact datagram of this call came (in time or late),
  // and the highest announcement among them (0: none heard).
  int ranks_heard = 0;
  uint64_t highest_announcement = 0;
  double coverage() const {
    return contributions_expected == 0 ? 1.0 : static_cast<double>(contributions_arrived) / contributions_expected;
  }
  double gathered() const {
    return gathered_expected == 0 ? 1.0 : static_cast<double>(gathered_arrived) / gathered_expected;
  }
};

// Writes the estimate of the group's elementwise mean of `input` into `output` (same length on every
// rank; output may be input). INVALID_ARGUMENT for mismatched spans or a transport whose datagrams
// cannot carry one element; ABORTED when the transport is aborted. Lost datagrams are not errors.
absl::StatusOr<LossyAllReduceResult> LossyAllReduceMean(DatagramTransport& transport,
                                                        const LossyAllReduceOptions& options,
                                                        absl::Span<const float> input, absl::Span<float> output);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_LOSSY_ALL_REDUCE_H_
