#include "engine/step_auth.h"

#include <openssl/crypto.h>

#include <cstring>

namespace dynamiq::engine {
namespace {

constexpr absl::string_view kKeyLabel = "dynamiq step key v1";

}  // namespace

StepAuthenticator::StepAuthenticator(absl::Span<const uint8_t> key) : hmac_(key) {}

common::HmacSha256::Digest StepAuthenticator::KeyForJob(absl::string_view secret, absl::string_view job_id) {
  static const uint8_t kSeparator = 0;
  return common::HmacSha256(secret).Mac(
      {common::AsBytes(kKeyLabel), absl::Span<const uint8_t>(&kSeparator, 1), common::AsBytes(job_id)});
}

std::unique_ptr<StepAuthenticator> StepAuthenticator::ForJob(absl::string_view secret, absl::string_view job_id) {
  const common::HmacSha256::Digest key = KeyForJob(secret, job_id);
  return std::make_unique<StepAuthenticator>(key);
}

StepTag StepAuthenticator::Tag(absl::Span<const uint8_t> covered, uint32_t receiver,
                               absl::Span<const uint8_t> payload) const {
  uint8_t to[4];
  for (int i = 0; i < 4; ++i) to[i] = static_cast<uint8_t>(receiver >> (8 * i));
  const common::HmacSha256::Digest mac = hmac_.Mac({covered, absl::Span<const uint8_t>(to, 4), payload});
  StepTag tag;
  std::memcpy(tag.data(), mac.data(), tag.size());
  return tag;
}

std::array<uint8_t, kStepHeaderBytes> StepAuthenticator::Seal(StepHeader header, uint32_t receiver,
                                                              absl::Span<const uint8_t> payload) const {
  header.authenticated = true;
  header.checksum = 0;
  header.tag = {};
  std::array<uint8_t, kStepHeaderBytes> bytes = EncodeStepHeader(header);
  const StepTag tag = Tag(absl::MakeConstSpan(bytes.data(), kStepHeaderMacCoverage), receiver, payload);
  std::memcpy(bytes.data() + kStepHeaderMacCoverage, tag.data(), tag.size());
  return bytes;
}

bool StepAuthenticator::Verify(absl::Span<const uint8_t> encoded, uint32_t receiver,
                               absl::Span<const uint8_t> payload) const {
  if (encoded.size() != kStepHeaderBytes) return false;
  const StepTag want = Tag(encoded.subspan(0, kStepHeaderMacCoverage), receiver, payload);
  return CRYPTO_memcmp(want.data(), encoded.data() + kStepHeaderMacCoverage, want.size()) == 0;
}

}  // namespace dynamiq::engine
