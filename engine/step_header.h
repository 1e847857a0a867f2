// StepHeader: the fixed 64-byte header every engine message is preceded by. A receiver first
// receives exactly 64 bytes, checks that the sender runs the same collective with the same
// configuration (job, config epoch, sequence, phase, step, block, codec, bits), and only then
// posts a receive of exactly `payload_bytes` (bounded by what the plan allows). This turns Gloo's
// silent short reads and fatal oversized sends into errors that name the rank and both values.
//
//   offset size field
//        0    4 magic            "DQS1"
//        4    1 version          2
//        5    1 phase            0 statistics, 1 reduce-scatter, 2 all-gather, 3 side lane
//        6    1 codec            CodecId
//        7    1 flags            bit 0: authenticated; bits 1-3: the schedule (ScheduleId:
//                                0 ring, 1 butterfly, 2 two-shot); the other bits must be 0
//        8    4 bits_x1000       the codec's bits setting x 1000 (e.g. 5000)
//       12    4 sender           rank of the sender
//       16    8 job_id
//       24    8 config_epoch
//       32    8 sequence         collective sequence number within the job
//       40    4 step
//       44    4 block            pipelining block
//       48    4 payload_bytes
//   not authenticated:
//       52    4 reserved         0
//       56    8 checksum         of the payload (PayloadChecksum)
//   authenticated (a cluster secret is configured, engine/step_auth.h):
//       52   12 tag              HMAC-SHA256 of bytes 0..51, the receiver's rank and the payload,
//                                truncated to 96 bits; replaces the checksum (it detects corruption too)
//
// Version 2 added the flags and the tag (version 1 had reserved zeros at byte 7); the schedule bits
// came later within version 2 (ring is 0, what every earlier header said), and so did phase 3 (a peer
// that predates it refuses a side lane as an unknown phase).
#ifndef DQ_ENGINE_STEP_HEADER_H_
#define DQ_ENGINE_STEP_HEADER_H_

#include <stddef.h>
#include <stdint.h>

#include <array>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/payload_checksum.h"

namespace dynamiq::engine {

inline constexpr size_t kStepHeaderBytes = 64;
// Bytes 0..51: what the tag of an authenticated header covers (with the receiver and the payload).
inline constexpr size_t kStepHeaderMacCoverage = 52;
inline constexpr size_t kStepTagBytes = kStepHeaderBytes - kStepHeaderMacCoverage;  // 12: 96 bits
using StepTag = std::array<uint8_t, kStepTagBytes>;

// kSideLane: the exact fp64 sums a collective carries beside its data (AllReduceOptions::side_sums).
enum class Phase : uint8_t { kStats = 0, kReduceScatter = 1, kAllGather = 2, kSideLane = 3 };

struct StepHeader {
  Phase phase = Phase::kReduceScatter;
  uint8_t codec = 0;
  uint8_t schedule = 0;  // ScheduleId (engine/schedule.h), 0..7
  uint32_t bits_x1000 = 0;
  uint32_t sender = 0;
  uint64_t job_id = 0;
  uint64_t config_epoch = 0;
  uint64_t sequence = 0;
  uint32_t step = 0;
  uint32_t block = 0;
  uint32_t payload_bytes = 0;
  // Exactly one of the two protects the payload: the tag when `authenticated`, else the checksum.
  bool authenticated = false;
  uint64_t checksum = 0;
  StepTag tag{};
};

std::array<uint8_t, kStepHeaderBytes> EncodeStepHeader(const StepHeader& header);

// Parses a header; INVALID_ARGUMENT for a wrong magic/version/phase, unknown flags or non-zero
// reserved bytes. The tag is not checked here (StepAuthenticator::Verify does, with the payload).
absl::StatusOr<StepHeader> DecodeStepHeader(absl::Span<const uint8_t> bytes);

// Compares a received header with the one this rank expects for the same transfer. The error
// names the sender and, for each differing field, the received and the expected value. Neither
// `authenticated`, the checksum nor the tag are compared (they depend on the payload).
absl::Status MatchStepHeader(const StepHeader& received, const StepHeader& expected);

// True if `status` (a MatchStepHeader error, however annotated on its way up with
// common::Annotate) says the sender runs another collective id: another job, incarnation, tensor
// name, size or dtype. In a daemon that means the nodes' workers submitted different tensors.
bool IsDifferentCollective(const absl::Status& status);

// 64-bit checksum of a payload (detects corruption, not forgery; kernels/payload_checksum.h, where
// codecs can compute it while they encode).
using kernels::PayloadChecksum;

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_STEP_HEADER_H_
