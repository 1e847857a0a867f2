#include "engine/step_header.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/codec.h"

namespace dynamiq::engine {
namespace {

constexpr uint32_t kMagic = 0x31535144u;  // "DQS1"
constexpr uint8_t kVersion = 2;
constexpr uint8_t kFlagAuthenticated = 1;
// Marks a MatchStepHeader error whose collective ids differ (IsDifferentCollective).
constexpr char kDifferentCollectivePayload[] = "type.dynamiq.dev/engine.DifferentCollective";

template <typename T>
void Put(uint8_t* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
}
template <typename T>
T Get(const uint8_t* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<T>(v);
}

absl::string_view PhaseName(Phase p) {
  switch (p) {
    case Phase::kStats:
      return "statistics";
    case Phase::kReduceScatter:
      return "reduce-scatter";
    case Phase::kAllGather:
      return "all-gather";
  }
  return "?";
}

}  // namespace

std::array<uint8_t, kStepHeaderBytes> EncodeStepHeader(const StepHeader& h) {
  std::array<uint8_t, kStepHeaderBytes> b{};
  Put<uint32_t>(&b[0], kMagic);
  b[4] = kVersion;
  b[5] = static_cast<uint8_t>(h.phase);
  b[6] = h.codec;
  b[7] = h.authenticated ? kFlagAuthenticated : 0;
  Put<uint32_t>(&b[8], h.bits_x1000);
  Put<uint32_t>(&b[12], h.sender);
  Put<uint64_t>(&b[16], h.job_id);
  Put<uint64_t>(&b[24], h.config_epoch);
  Put<uint64_t>(&b[32], h.sequence);
  Put<uint32_t>(&b[40], h.step);
  Put<uint32_t>(&b[44], h.block);
  Put<uint32_t>(&b[48], h.payload_bytes);
  if (h.authenticated) {
    std::memcpy(&b[kStepHeaderMacCoverage], h.tag.data(), kStepTagBytes);
  } else {
    Put<uint64_t>(&b[56], h.checksum);
  }
  return b;
}

absl::StatusOr<StepHeader> DecodeStepHeader(absl::Span<const uint8_t> b) {
  if (b.size() != kStepHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("step header of ", b.size(), " bytes, expected ", kStepHeaderBytes));
  }
  if (Get<uint32_t>(&b[0]) != kMagic) return absl::InvalidArgumentError("not a dynamiq step header (bad magic)");
  if (b[4] != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("step header version ", b[4], ", this build speaks ", kVersion));
  }
  if (b[5] > 2) return absl::InvalidArgumentError(absl::StrCat("step header with unknown phase ", b[5]));
  if ((b[7] & ~kFlagAuthenticated) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("step header with unknown flags ", b[7]));
  }
  const bool authenticated = (b[7] & kFlagAuthenticated) != 0;
  if (!authenticated && Get<uint32_t>(&b[52]) != 0) return absl::InvalidArgumentError("step header reserved bytes set");
  StepHeader h;
  h.authenticated = authenticated;
  h.phase = static_cast<Phase>(b[5]);
  h.codec = b[6];
  h.bits_x1000 = Get<uint32_t>(&b[8]);
  h.sender = Get<uint32_t>(&b[12]);
  h.job_id = Get<uint64_t>(&b[16]);
  h.config_epoch = Get<uint64_t>(&b[24]);
  h.sequence = Get<uint64_t>(&b[32]);
  h.step = Get<uint32_t>(&b[40]);
  h.block = Get<uint32_t>(&b[44]);
  h.payload_bytes = Get<uint32_t>(&b[48]);
  if (authenticated) {
    std::memcpy(h.tag.data(), &b[kStepHeaderMacCoverage], kStepTagBytes);
  } else {
    h.checksum = Get<uint64_t>(&b[56]);
  }
  return h;
}

absl::Status MatchStepHeader(const StepHeader& r, const StepHeader& e) {
  std::vector<std::string> diffs;
  auto check = [&](absl::string_view field, const std::string& got, const std::string& want) {
    if (got != want) diffs.push_back(absl::StrCat(field, " ", got, " (expected ", want, ")"));
  };
  check("sender", absl::StrCat(r.sender), absl::StrCat(e.sender));
  check("job", absl::StrCat(r.job_id), absl::StrCat(e.job_id));
  check("config epoch", absl::StrCat(r.config_epoch), absl::StrCat(e.config_epoch));
  check("collective", absl::StrCat(r.sequence), absl::StrCat(e.sequence));
  check("phase", std::string(PhaseName(r.phase)), std::string(PhaseName(e.phase)));
  check("step", absl::StrCat(r.step), absl::StrCat(e.step));
  check("block", absl::StrCat(r.block), absl::StrCat(e.block));
  check("codec", std::string(kernels::CodecName(static_cast<kernels::CodecId>(r.codec))),
        std::string(kernels::CodecName(static_cast<kernels::CodecId>(e.codec))));
  check("bits", absl::StrCat(r.bits_x1000 / 1000.0), absl::StrCat(e.bits_x1000 / 1000.0));
  if (diffs.empty()) return absl::OkStatus();
  absl::Status mismatch = absl::FailedPreconditionError(
      absl::StrCat("rank ", r.sender, " runs a different collective: ", absl::StrJoin(diffs, ", ")));
  if (r.job_id != e.job_id) mismatch.SetPayload(kDifferentCollectivePayload, absl::Cord());
  return mismatch;
}

bool IsDifferentCollective(const absl::Status& status) {
  return status.GetPayload(kDifferentCollectivePayload).has_value();
}

// x86-64 builds with GCC also get an AVX-512 clone of the checksum, picked at load time (4x faster
// there; AVX2 alone does not help, as 64-bit lanes lack what the loop needs). Integer arithmetic:
// every clone computes the same value.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DQ_CHECKSUM_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define DQ_CHECKSUM_CLONES
#endif

DQ_CHECKSUM_CLONES uint64_t PayloadChecksum(absl::Span<const uint8_t> p) {
  // Eight 64-bit lanes over 64-byte stripes, each adding the 32x32-bit product of its word's halves
  // (keyed per lane and, through a Weyl sequence, per stripe, so moved stripes change the sum) and
  // its neighbour lane's raw word. Written so compilers vectorize it (32x32-bit products are one
  // SIMD instruction where 64-bit multiplies are not): this runs on every message, both sides.
  constexpr uint64_t kLaneKeys[8] = {0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full, 0x165667b19e3779f9ull,
                                     0x27d4eb2f165667c5ull, 0x85ebca77c2b2ae63ull, 0xff51afd7ed558ccdull,
                                     0xc4ceb9fe1a85ec53ull, 0x94d049bb133111ebull};
  uint64_t acc[8] = {0x1234567890abcdefull, 0x0fedcba987654321ull, 0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull,
                     0x510e527fade682d1ull, 0x9b05688c2b3e6c1full, 0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};
  uint64_t salt = 0;
  size_t i = 0;
  for (; i + 64 <= p.size(); i += 64) {
    salt += 0x9e3779b97f4a7c15ull;
    uint64_t w[8], product[8];
    std::memcpy(w, p.data() + i, 64);
    for (int lane = 0; lane < 8; ++lane) {
      const uint64_t k = w[lane] ^ kLaneKeys[lane] ^ salt;
      product[lane] = static_cast<uint64_t>(static_cast<uint32_t>(k)) * static_cast<uint32_t>(k >> 32);
    }
    for (int lane = 0; lane < 8; lane += 2) {
      acc[lane] += product[lane] + w[lane + 1];
      acc[lane + 1] += product[lane + 1] + w[lane];
    }
  }
  uint64_t h = p.size() * 0x9e3779b97f4a7c15ull;
  for (; i < p.size(); ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  for (int lane = 0; lane < 8; ++lane) {
    h = (h ^ acc[lane]) * 0xff51afd7ed558ccdull;
    h ^= h >> 33;
  }
  return h;
}

}  // namespace dynamiq::engine
