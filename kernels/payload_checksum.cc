#include "kernels/payload_checksum.h"

#include <algorithm>
#include <cstring>

namespace dynamiq::kernels {
namespace {

// Eight 64-bit lanes over 64-byte stripes, each adding the 32x32-bit product of its word's halves
// (keyed per lane and, through a Weyl sequence, per stripe, so moved stripes change the sum) and
// its neighbour lane's raw word. Written so compilers vectorize it (32x32-bit products are one SIMD
// instruction where 64-bit multiplies are not).
constexpr uint64_t kLaneKeys[8] = {0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full, 0x165667b19e3779f9ull,
                                   0x27d4eb2f165667c5ull, 0x85ebca77c2b2ae63ull, 0xff51afd7ed558ccdull,
                                   0xc4ceb9fe1a85ec53ull, 0x94d049bb133111ebull};
constexpr uint64_t kSeeds[8] = {0x1234567890abcdefull, 0x0fedcba987654321ull, 0x3c6ef372fe94f82bull,
                                0xa54ff53a5f1d36f1ull, 0x510e527fade682d1ull, 0x9b05688c2b3e6c1full,
                                0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};

// x86-64 builds with GCC also get an AVX-512 clone of the stripe loop, picked at load time (4x
// faster there; AVX2 alone does not help, as 64-bit lanes lack what the loop needs). Integer
// arithmetic: every clone computes the same value.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DQ_CHECKSUM_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define DQ_CHECKSUM_CLONES
#endif

// Adds `stripes` whole 64-byte stripes at `p`. The state is copied into locals: through the
// pointers, the byte loads could alias it, and the loop would neither stay in registers nor
// vectorize (4x slower).
DQ_CHECKSUM_CLONES void AddStripes(uint64_t* acc_inout, uint64_t& salt_inout, const uint8_t* p, size_t stripes) {
  uint64_t acc[8];
  std::memcpy(acc, acc_inout, sizeof(acc));
  uint64_t salt = salt_inout;
  for (size_t s = 0; s < stripes; ++s, p += 64) {
    salt += 0x9e3779b97f4a7c15ull;
    uint64_t w[8], product[8];
    std::memcpy(w, p, 64);
    for (int lane = 0; lane < 8; ++lane) {
      const uint64_t k = w[lane] ^ kLaneKeys[lane] ^ salt;
      product[lane] = static_cast<uint64_t>(static_cast<uint32_t>(k)) * static_cast<uint32_t>(k >> 32);
    }
    for (int lane = 0; lane < 8; lane += 2) {
      acc[lane] += product[lane] + w[lane + 1];
      acc[lane + 1] += product[lane + 1] + w[lane];
    }
  }
  std::memcpy(acc_inout, acc, sizeof(acc));
  salt_inout = salt;
}

// The tail (fewer than 64 bytes after the last stripe) and the size, mixed with the lanes.
uint64_t Mix(const uint64_t* acc, uint64_t size, const uint8_t* tail, size_t tail_bytes) {
  uint64_t h = size * 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < tail_bytes; ++i) h = (h ^ tail[i]) * 0x100000001b3ull;
  for (int lane = 0; lane < 8; ++lane) {
    h = (h ^ acc[lane]) * 0xff51afd7ed558ccdull;
    h ^= h >> 33;
  }
  return h;
}

}  // namespace

uint64_t PayloadChecksum(absl::Span<const uint8_t> p) {
  uint64_t acc[8];
  std::memcpy(acc, kSeeds, sizeof(acc));
  uint64_t salt = 0;
  const size_t stripes = p.size() / 64;
  AddStripes(acc, salt, p.data(), stripes);
  return Mix(acc, p.size(), p.data() + 64 * stripes, p.size() - 64 * stripes);
}

uint64_t PayloadChecksum(absl::Span<const uint8_t> head, absl::Span<const uint8_t> body) {
  PayloadChecksummer summer;
  summer.Update(head);
  summer.Update(body);
  return summer.Finish();
}

PayloadChecksummer::PayloadChecksummer() { std::memcpy(acc_, kSeeds, sizeof(acc_)); }

void PayloadChecksummer::Update(absl::Span<const uint8_t> bytes) {
  if (bytes.empty()) return;  // (its data may be null, which memcpy must not see)
  size_ += bytes.size();
  const uint8_t* p = bytes.data();
  size_t n = bytes.size();
  if (carried_ > 0) {
    const size_t take = std::min(n, 64 - carried_);
    std::memcpy(carry_ + carried_, p, take);
    carried_ += take, p += take, n -= take;
    if (carried_ < 64) return;
    AddStripes(acc_, salt_, carry_, 1);
    carried_ = 0;
  }
  const size_t stripes = n / 64;
  AddStripes(acc_, salt_, p, stripes);
  carried_ = n - 64 * stripes;
  if (carried_ > 0) std::memcpy(carry_, p + 64 * stripes, carried_);
}

uint64_t PayloadChecksummer::Finish() const { return Mix(acc_, size_, carry_, carried_); }

}  // namespace dynamiq::kernels
