#include "kernels/dynamiq_allocator.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/dynamiq_math.h"

namespace dynamiq::kernels {
namespace {

constexpr int kWidths[3] = {2, 4, 8};

// Super-group indices sorted by energy, descending (ties by index, so the order is deterministic).
std::vector<uint32_t> ByEnergyDescending(absl::Span<const double> energy) {
  std::vector<uint32_t> order(energy.size());
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return energy[a] != energy[b] ? energy[a] > energy[b] : a < b; });
  return order;
}

}  // namespace

double SuperGroupPayloadBits(int width) { return width == 0 ? 0.0 : 256.0 * width + 144.0; }

Allocation AllocateWidths(absl::Span<const double> energy, size_t num_elements, double bits_per_coord,
                          BitAllocator allocator, const WidthErrors& errors) {
  const size_t m = energy.size();
  Allocation out;
  out.widths.assign(m, 2);
  if (m == 0) return out;
  const bool measured = allocator == BitAllocator::kMeasured;
  const double rho = measured ? (errors[1] - errors[2]) / (2.0 * (errors[0] - errors[1])) : 17.0 / 512.0;

  // Sorted energies turn "bits used at threshold tau" into two binary searches.
  std::vector<uint32_t> order = ByEnergyDescending(energy);
  std::vector<double> sorted(m);
  for (size_t i = 0; i < m; ++i) sorted[i] = energy[order[i]];
  size_t zeros = 0;
  if (measured) {
    while (zeros < m && sorted[m - 1 - zeros] == 0.0) ++zeros;
  }
  const size_t active = m - zeros;
  // Number of active super-groups with energy >= x.
  auto count_at_least = [&](double x) {
    return static_cast<size_t>(std::upper_bound(sorted.begin(), sorted.begin() + active, x, std::greater<double>()) -
                               sorted.begin());
  };
  const double budget = bits_per_coord * static_cast<double>(num_elements) - kFixedBitsPerSuperGroup * m;
  auto bits_used = [&](double log_tau) {
    size_t n8 = count_at_least(std::exp2(log_tau));
    size_t n4 = count_at_least(std::exp2(log_tau) * rho) - n8;
    return n8 * SuperGroupPayloadBits(8) + n4 * SuperGroupPayloadBits(4) +
           (active - n8 - n4) * SuperGroupPayloadBits(2);
  };

  // Bisect log2(tau): bits_used is non-increasing in tau. Bounds cover every positive double.
  double lo = -1100.0, hi = 1100.0;  // bits_used(hi) = all 2-bit; find the smallest tau that fits
  if (bits_used(lo) <= budget) {
    hi = lo;
  } else {
    for (int it = 0; it < 200 && hi - lo > 1e-9; ++it) {
      double mid = 0.5 * (lo + hi);
      (bits_used(mid) <= budget ? hi : lo) = mid;
    }
  }
  const double tau = std::exp2(hi);
  size_t n8 = count_at_least(tau);
  size_t n4 = count_at_least(tau * rho);
  for (size_t i = 0; i < m; ++i) {
    out.widths[order[i]] = i >= active ? 0 : (i < n8 ? 8 : (i < n4 ? 4 : 2));
  }
  double used = bits_used(hi);

  if (measured) {
    // Spend the leftover on upgrades in order of error removed per bit. Within a width class the
    // best candidate is the highest-energy one, i.e. the next index in `order`.
    size_t next8 = n8, next4 = n4;  // next candidates for 4->8 and 2->4 upgrades
    const double d48 = SuperGroupPayloadBits(8) - SuperGroupPayloadBits(4);
    const double d24 = SuperGroupPayloadBits(4) - SuperGroupPayloadBits(2);
    for (size_t steps = 0; steps < 2 * m; ++steps) {
      double g8 = -1, g4 = -1;
      if (next8 < active && next8 < next4 && used + d48 <= budget) g8 = sorted[next8] * (errors[1] - errors[2]) / d48;
      if (next4 < active && used + d24 <= budget) g4 = sorted[next4] * (errors[0] - errors[1]) / d24;
      if (g8 < 0 && g4 < 0) break;
      if (g8 >= g4) {
        out.widths[order[next8++]] = 8;
        used += d48;
      } else {
        out.widths[order[next4++]] = 4;
        used += d24;
      }
    }
  }
  out.bits_per_coord = (used + kFixedBitsPerSuperGroup * m) / static_cast<double>(num_elements);
  return out;
}

}  // namespace dynamiq::kernels
