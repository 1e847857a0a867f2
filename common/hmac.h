// HmacSha256: HMAC-SHA256 (RFC 2104) keyed once and used for many messages, on OpenSSL's libcrypto.
// dynamiq uses it to derive keys and tokens from a cluster secret and to authenticate engine
// messages (engine/step_auth.h). ConstantTimeEquals compares secrets without leaking where they
// differ.
//
// Thread-safe: Mac() only reads the keyed state (each call works on its own copy).
#ifndef DQ_COMMON_HMAC_H_
#define DQ_COMMON_HMAC_H_

#include <stddef.h>
#include <stdint.h>

#include <array>
#include <initializer_list>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dynamiq::common {

class HmacSha256 {
 public:
  static constexpr size_t kBytes = 32;
  using Digest = std::array<uint8_t, kBytes>;

  explicit HmacSha256(absl::Span<const uint8_t> key);
  explicit HmacSha256(absl::string_view key);
  ~HmacSha256();
  HmacSha256(const HmacSha256&) = delete;
  HmacSha256& operator=(const HmacSha256&) = delete;

  // The MAC of the concatenation of `parts`.
  Digest Mac(std::initializer_list<absl::Span<const uint8_t>> parts) const;
  Digest Mac(absl::string_view message) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Lower-case hex of `bytes`.
std::string HexEncode(absl::Span<const uint8_t> bytes);

// Equality of two secrets in time that depends on neither their contents nor (beyond a hash of
// each) their lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

inline absl::Span<const uint8_t> AsBytes(absl::string_view s) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

}  // namespace dynamiq::common

#endif  // DQ_COMMON_HMAC_H_
