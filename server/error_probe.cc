#include "server/error_probe.h"

#include <cmath>

namespace dynamiq::server {
namespace {

// SplitMix64's finalizer: a bijective mix whose output bits all depend on all input bits.
uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

bool SampleForError(absl::string_view job_id, uint64_t sequence, double rate) {
  if (!(rate > 0)) return false;  // also NaN
  if (rate >= 1) return true;
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the job id
  for (char c : job_id) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  const uint64_t x = Mix(h ^ Mix(sequence + 0x9e3779b97f4a7c15ull));
  const double u = static_cast<double>(x >> 11) * 0x1.0p-53;  // uniform in [0, 1)
  return u < rate;
}

uint64_t ErrorProbeSequence(uint64_t sequence) { return sequence ^ (uint64_t{1} << 63) ^ (uint64_t{1} << 23); }

std::optional<double> Vnmse(const float* result, const float* exact, size_t n) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(result[i]) - exact[i];
    err += d * d;
    norm += static_cast<double>(exact[i]) * exact[i];
  }
  if (!std::isfinite(err) || !std::isfinite(norm) || norm == 0) return std::nullopt;
  return err / norm;
}

}  // namespace dynamiq::server
