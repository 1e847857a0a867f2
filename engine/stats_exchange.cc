#include "engine/stats_exchange.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/bf16_math.h"

namespace dynamiq::engine {
namespace {

uint16_t Load(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

}  // namespace

std::vector<uint8_t> EncodeStatsBf16(absl::Span<const float> values) {
  std::vector<uint8_t> bytes(2 * values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t h = kernels::FloatToBf16(values[i]);
    bytes[2 * i] = static_cast<uint8_t>(h & 0xff);
    bytes[2 * i + 1] = static_cast<uint8_t>(h >> 8);
  }
  return bytes;
}

absl::StatusOr<std::vector<uint8_t>> SumStatsBf16(absl::Span<const absl::Span<const uint8_t>> contributions,
                                                  size_t expected_bytes) {
  if (expected_bytes % 2 != 0) return absl::InvalidArgumentError("bf16 statistics have an odd byte count");
  for (size_t r = 0; r < contributions.size(); ++r) {
    if (contributions[r].size() != expected_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("statistics from rank ", r, " have ", contributions[r].size(),
                                                     " bytes, expected ", expected_bytes));
    }
  }
  std::vector<float> sum(expected_bytes / 2, 0.0f);
  for (absl::Span<const uint8_t> c : contributions) {
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += kernels::Bf16ToFloat(Load(&c[2 * i]));
  }
  return EncodeStatsBf16(sum);
}

absl::Status DecodeStatsBf16(absl::Span<const uint8_t> bytes, absl::Span<float> out) {
  if (bytes.size() != 2 * out.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduced statistics have ", bytes.size(), " bytes, expected ", 2 * out.size()));
  }
  for (size_t i = 0; i < out.size(); ++i) out[i] = kernels::Bf16ToFloat(Load(&bytes[2 * i]));
  return absl::OkStatus();
}

}  // namespace dynamiq::engine
