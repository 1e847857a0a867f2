#include "common/hmac.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <cstdio>
#include <cstdlib>

namespace dynamiq::common {
namespace {

// libcrypto fails here only without memory or without its default provider (a broken install):
// neither can be handled meaningfully by a caller, like std::bad_alloc.
[[noreturn]] void Fatal(const char* what) {
  std::fprintf(stderr, "dynamiq: libcrypto HMAC-SHA256 failed in %s\n", what);
  std::abort();
}

EVP_MAC* FetchHmac() {
  static EVP_MAC* const mac = [] {
    EVP_MAC* m = EVP_MAC_fetch(nullptr, OSSL_MAC_NAME_HMAC, nullptr);
    if (m == nullptr) Fatal("EVP_MAC_fetch");
    return m;
  }();
  return mac;
}

}  // namespace

struct HmacSha256::State {
  EVP_MAC_CTX* keyed = nullptr;  // initialised with the key; Mac() works on copies
  ~State() { EVP_MAC_CTX_free(keyed); }
};

HmacSha256::HmacSha256(absl::Span<const uint8_t> key) : state_(std::make_unique<State>()) {
  state_->keyed = EVP_MAC_CTX_new(FetchHmac());
  if (state_->keyed == nullptr) Fatal("EVP_MAC_CTX_new");
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  // An empty key is legal HMAC; OpenSSL wants a non-null pointer for it.
  static const uint8_t kEmpty = 0;
  if (EVP_MAC_init(state_->keyed, key.empty() ? &kEmpty : key.data(), key.size(), params) != 1) Fatal("EVP_MAC_init");
}

HmacSha256::HmacSha256(absl::string_view key) : HmacSha256(AsBytes(key)) {}

HmacSha256::~HmacSha256() = default;

HmacSha256::Digest HmacSha256::Mac(std::initializer_list<absl::Span<const uint8_t>> parts) const {
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_dup(state_->keyed);
  if (ctx == nullptr) Fatal("EVP_MAC_CTX_dup");
  for (absl::Span<const uint8_t> part : parts) {
    if (!part.empty() && EVP_MAC_update(ctx, part.data(), part.size()) != 1) Fatal("EVP_MAC_update");
  }
  Digest out;
  size_t length = 0;
  if (EVP_MAC_final(ctx, out.data(), &length, out.size()) != 1 || length != out.size()) Fatal("EVP_MAC_final");
  EVP_MAC_CTX_free(ctx);
  return out;
}

HmacSha256::Digest HmacSha256::Mac(absl::string_view message) const { return Mac({AsBytes(message)}); }

std::string HexEncode(absl::Span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * bytes.size());
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Fixed-length digests, so neither the contents nor the length of the expected value leak
  // through timing; SHA-256 collisions are out of reach.
  uint8_t da[EVP_MAX_MD_SIZE], db[EVP_MAX_MD_SIZE];
  unsigned int la = 0, lb = 0;
  if (EVP_Digest(a.data(), a.size(), da, &la, EVP_sha256(), nullptr) != 1 ||
      EVP_Digest(b.data(), b.size(), db, &lb, EVP_sha256(), nullptr) != 1) {
    Fatal("EVP_Digest");
  }
  return la == lb && CRYPTO_memcmp(da, db, la) == 0;
}

}  // namespace dynamiq::common
