// StepHeader: the fixed 64-byte header every engine message is preceded by. A receiver first
// receives exactly 64 bytes, checks that the sender runs the same collective with the same
// configuration (job, config epoch, sequence, phase, step, block, codec, bits), and only then
// posts a receive of exactly `payload_bytes` (bounded by what the plan allows). This turns Gloo's
// silent short reads and fatal oversized sends into errors that name the rank and both values.
//
//   offset size field
//        0    4 magic            "DQS1"
//        4    1 version          1
//        5    1 phase            0 statistics, 1 reduce-scatter, 2 all-gather
//        6    1 codec            CodecId
//        7    1 reserved         0
//        8    4 bits_x1000       the codec's bits setting x 1000 (e.g. 5000)
//       12    4 sender           rank of the sender
//       16    8 job_id
//       24    8 config_epoch
//       32    8 sequence         collective sequence number within the job
//       40    4 step
//       44    4 block            pipelining block
//       48    4 payload_bytes
//       52    4 reserved         0
//       56    8 checksum         of the payload (PayloadChecksum)
#ifndef DQ_ENGINE_STEP_HEADER_H_
#define DQ_ENGINE_STEP_HEADER_H_

#include <stddef.h>
#include <stdint.h>

#include <array>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dynamiq::engine {

inline constexpr size_t kStepHeaderBytes = 64;

enum class Phase : uint8_t { kStats = 0, kReduceScatter = 1, kAllGather = 2 };

struct StepHeader {
  Phase phase = Phase::kReduceScatter;
  uint8_t codec = 0;
  uint32_t bits_x1000 = 0;
  uint32_t sender = 0;
  uint64_t job_id = 0;
  uint64_t config_epoch = 0;
  uint64_t sequence = 0;
  uint32_t step = 0;
  uint32_t block = 0;
  uint32_t payload_bytes = 0;
  uint64_t checksum = 0;
};

std::array<uint8_t, kStepHeaderBytes> EncodeStepHeader(const StepHeader& header);

// Parses a header; INVALID_ARGUMENT for a wrong magic/version/phase or non-zero reserved bytes.
absl::StatusOr<StepHeader> DecodeStepHeader(absl::Span<const uint8_t> bytes);

// Compares a received header with the one this rank expects for the same transfer. The error
// names the sender and, for each differing field, the received and the expected value.
absl::Status MatchStepHeader(const StepHeader& received, const StepHeader& expected);

// 64-bit checksum of a payload (detects corruption, not forgery).
uint64_t PayloadChecksum(absl::Span<const uint8_t> payload);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_STEP_HEADER_H_
