// StepAuthenticator: message authentication for the engine's step messages, so that a process on
// the network cannot inject or alter what ranks exchange (gradients, statistics).
//
// Each message's 64-byte StepHeader (engine/step_header.h) is sent "authenticated": its last 12
// bytes hold HMAC-SHA256, truncated to 96 bits, over
//   header bytes 0..51 (magic, version, flags, phase, codec, bits, sender, job, config epoch,
//   collective sequence, step, block, payload size) || receiver rank (u32 LE) || payload,
// keyed with the job's key. The receiver checks it after the payload arrived and before anything
// decodes the payload; a message that fails is never decoded and fails the collective with
// UNAUTHENTICATED naming the peer rank. Binding the sender, receiver and position in the
// collective means a captured message cannot be replayed into another collective, step, block or
// link of the same job; the job key means it cannot be replayed into another job.
//
// Keys: KeyForJob derives a job's 32-byte key from the cluster secret (shared by every node, read
// from dynamiqd's --cluster_secret_file) as HMAC-SHA256(secret, "dynamiq step key v1" 0x00 job_id).
//
// Thread-safe (immutable after construction).
#ifndef DQ_ENGINE_STEP_AUTH_H_
#define DQ_ENGINE_STEP_AUTH_H_

#include <stdint.h>

#include <array>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/hmac.h"
#include "engine/step_header.h"

namespace dynamiq::engine {

class StepAuthenticator {
 public:
  explicit StepAuthenticator(absl::Span<const uint8_t> key);

  // The authenticator of job `job_id` (the daemon's job id string) in a cluster sharing `secret`.
  static std::unique_ptr<StepAuthenticator> ForJob(absl::string_view secret, absl::string_view job_id);
  static common::HmacSha256::Digest KeyForJob(absl::string_view secret, absl::string_view job_id);

  // The encoded header, marked authenticated and carrying the tag, of a message to `receiver`.
  std::array<uint8_t, kStepHeaderBytes> Seal(StepHeader header, uint32_t receiver,
                                             absl::Span<const uint8_t> payload) const;
  // Whether `encoded` (a received, authenticated header) carries the right tag for `payload` sent
  // to `receiver`. Constant time in the tag.
  bool Verify(absl::Span<const uint8_t> encoded, uint32_t receiver, absl::Span<const uint8_t> payload) const;

 private:
  StepTag Tag(absl::Span<const uint8_t> covered, uint32_t receiver, absl::Span<const uint8_t> payload) const;

  common::HmacSha256 hmac_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_STEP_AUTH_H_
