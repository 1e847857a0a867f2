// PayloadChecksum: the 64-bit checksum of a message payload that the engine's step header carries
// (engine/step_header.h) and the receiver verifies before decoding, where no cluster secret makes
// it an HMAC. A non-cryptographic hash against corruption in transit (bit flips that TCP's 16-bit
// checksum misses, software bugs), fast enough to run on every message, both sides.
//
// PayloadChecksummer computes the same value from the payload's bytes in pieces, so a codec can
// checksum a message as it writes it (one pass over the message instead of two).
#ifndef DQ_KERNELS_PAYLOAD_CHECKSUM_H_
#define DQ_KERNELS_PAYLOAD_CHECKSUM_H_

#include <stddef.h>
#include <stdint.h>

#include "absl/types/span.h"

namespace dynamiq::kernels {

uint64_t PayloadChecksum(absl::Span<const uint8_t> payload);
// The checksum of `head` followed by `body`: a payload kept in two places (Codec::BodyIsFloat32).
uint64_t PayloadChecksum(absl::Span<const uint8_t> head, absl::Span<const uint8_t> body);

class PayloadChecksummer {
 public:
  PayloadChecksummer();
  // Appends bytes; any split of a payload gives PayloadChecksum of the whole.
  void Update(absl::Span<const uint8_t> bytes);
  // The checksum of everything appended so far.
  uint64_t Finish() const;

 private:
  uint64_t acc_[8];
  uint64_t salt_ = 0;
  uint64_t size_ = 0;  // bytes appended
  uint8_t carry_[64];  // the start of an incomplete stripe
  size_t carried_ = 0;
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_PAYLOAD_CHECKSUM_H_
