#include "kernels/dynamiq_allocator.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "common/status_macros.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::kernels {
namespace {

// A width choice for a super-group: its payload bits and relative error.
struct Option {
  int width;
  double bits;
  double error;
};

// The widths worth using: the lower convex hull of (bits, error), cheapest first. A width above
// the hull is never the best choice for any energy.
std::vector<Option> Hull(const std::vector<int>& widths, const WidthErrors& errors) {
  std::vector<Option> hull;
  for (int w : widths) {
    Option o{w, SuperGroupPayloadBits(w), errors[w]};
    if (!hull.empty() && hull.back().error <= o.error) break;  // more bits, no gain
    while (hull.size() >= 2) {
      const Option& a = hull[hull.size() - 2];
      const Option& b = hull.back();
      // b is above the segment a-o: its marginal gain per bit is below o's.
      if ((a.error - b.error) / (b.bits - a.bits) <= (b.error - o.error) / (o.bits - b.bits)) {
        hull.pop_back();
      } else {
        break;
      }
    }
    hull.push_back(o);
  }
  return hull;
}

}  // namespace

// An LSD radix sort on the energies' bits (non-negative doubles order as their bit patterns), stable
// so ties keep index order; digits that every key shares are skipped, and there are many: energies
// are squares of bf16 norms, with at most 16 significant bits. A comparison sort took most of the
// plan's time at 64K super-groups.
std::vector<uint32_t> ByEnergyDescending(absl::Span<const double> energy) {
  const size_t m = energy.size();
  std::vector<uint64_t> keys(m);
  for (size_t i = 0; i < m; ++i) {
    uint64_t bits;
    std::memcpy(&bits, &energy[i], sizeof(bits));
    keys[i] = ~(energy[i] > 0 ? bits : 0);  // ascending complement = descending energy; -0 ties +0
  }
  constexpr int kDigitBits = 8, kDigits = 64 / kDigitBits, kBuckets = 1 << kDigitBits;
  std::vector<std::array<uint32_t, kBuckets>> counts(kDigits);
  for (auto& c : counts) c.fill(0);
  for (uint64_t key : keys) {
    for (int d = 0; d < kDigits; ++d) ++counts[d][(key >> (kDigitBits * d)) & (kBuckets - 1)];
  }
  std::vector<uint32_t> order(m), next(m);
  std::iota(order.begin(), order.end(), 0u);
  for (int d = 0; d < kDigits; ++d) {
    const int shift = kDigitBits * d;
    if (m == 0 || counts[d][(keys[0] >> shift) & (kBuckets - 1)] == m) continue;  // one digit value: no-op
    uint32_t start[kBuckets];
    uint32_t total = 0;
    for (int b = 0; b < kBuckets; ++b) start[b] = total, total += counts[d][b];
    for (uint32_t i : order) next[start[(keys[i] >> shift) & (kBuckets - 1)]++] = i;
    order.swap(next);
  }
  return order;
}

std::vector<double> EnergiesFromStats(absl::Span<const float> reduced_stats) {
  std::vector<double> energy(reduced_stats.size() / 2);
  for (size_t j = 0; j < energy.size(); ++j) {
    const double norm = reduced_stats[2 * j + 1];
    // Non-finite norms (Inf/NaN gradients) sort first and get 8 bits; the super-group decodes to NaN.
    energy[j] = std::isfinite(norm) ? norm * norm : HUGE_VAL;
  }
  return energy;
}

double SuperGroupPayloadBits(int width) { return width == 0 ? 0.0 : 256.0 * width + 144.0; }

Allocation AllocateWidths(absl::Span<const double> energy, size_t num_elements, double bits_per_coord,
                          BitAllocator allocator, const WidthErrors& errors) {
  const size_t m = energy.size();
  Allocation out;
  if (m == 0) return out;
  const bool measured = allocator == BitAllocator::kMeasured;
  std::vector<Option> hull;
  if (measured) {
    hull = Hull({2, 3, 4, 5, 6, 7, 8}, errors);
  } else {
    // The paper's thresholds are the equal-marginal-gain points of errors 4^-w.
    for (int w : {2, 4, 8}) hull.push_back(Option{w, SuperGroupPayloadBits(w), std::pow(4.0, -w)});
  }
  const size_t levels = hull.size();
  // Energy ratio of each upgrade threshold to the top one: upgrade i (hull[i] -> hull[i+1]) pays off
  // above lambda / gain_per_bit[i].
  std::vector<double> gain_per_bit(levels - 1);
  for (size_t i = 0; i + 1 < levels; ++i) {
    gain_per_bit[i] = (hull[i].error - hull[i + 1].error) / (hull[i + 1].bits - hull[i].bits);
  }

  std::vector<uint32_t> order = ByEnergyDescending(energy);
  std::vector<double> sorted(m);
  for (size_t i = 0; i < m; ++i) sorted[i] = energy[order[i]];
  size_t active = m;
  if (measured) {
    while (active > 0 && sorted[active - 1] == 0.0) --active;
  }
  // Number of active super-groups with energy >= x.
  auto count_at_least = [&](double x) {
    return static_cast<size_t>(std::upper_bound(sorted.begin(), sorted.begin() + active, x, std::greater<double>()) -
                               sorted.begin());
  };
  // With multiplier 2^log_lambda: counts[i] = super-groups taking at least upgrade i.
  auto counts_at = [&](double log_lambda) {
    std::vector<size_t> counts(levels - 1);
    for (size_t i = 0; i + 1 < levels; ++i) counts[i] = count_at_least(std::exp2(log_lambda) / gain_per_bit[i]);
    return counts;
  };
  auto bits_of = [&](const std::vector<size_t>& counts) {
    double bits = active * hull[0].bits;
    for (size_t i = 0; i + 1 < levels; ++i) bits += counts[i] * (hull[i + 1].bits - hull[i].bits);
    return bits;
  };
  const double budget = bits_per_coord * static_cast<double>(num_elements) - kFixedBitsPerSuperGroup * m;

  // Bisect log2(lambda): bits are non-increasing in lambda. Bounds cover every positive double.
  double lo = -2200.0, hi = 2200.0;
  if (bits_of(counts_at(lo)) <= budget) {
    hi = lo;
  } else {
    for (int it = 0; it < 200 && hi - lo > 1e-9; ++it) {
      const double mid = 0.5 * (lo + hi);
      (bits_of(counts_at(mid)) <= budget ? hi : lo) = mid;
    }
  }
  std::vector<size_t> counts = counts_at(hi);
  // Convexity makes counts non-increasing in i; enforce it against rounding at equal thresholds.
  for (size_t i = 1; i + 1 < levels; ++i) counts[i] = std::min(counts[i], counts[i - 1]);
  double used = bits_of(counts);

  // level[i] of the super-group at sorted position p: how many upgrades it took.
  std::vector<uint8_t> level(m, 0);
  for (size_t i = 0; i + 1 < levels; ++i) {
    for (size_t p = 0; p < counts[i]; ++p) level[p] = static_cast<uint8_t>(i + 1);
  }
  if (measured) {
    // Spend the leftover on single upgrades in order of error removed per bit. Within a level the
    // best candidate is the highest-energy one, i.e. position counts[i] in sorted order.
    for (size_t steps = 0; steps < m * levels; ++steps) {
      double best = -1;
      size_t best_i = 0;
      for (size_t i = 0; i + 1 < levels; ++i) {
        const size_t p = counts[i];
        const double cost = hull[i + 1].bits - hull[i].bits;
        if (p >= active || (i > 0 && p >= counts[i - 1]) || used + cost > budget) continue;
        const double gain = sorted[p] * gain_per_bit[i];
        if (gain > best) best = gain, best_i = i;
      }
      if (best < 0) break;
      level[counts[best_i]] = static_cast<uint8_t>(best_i + 1);
      used += hull[best_i + 1].bits - hull[best_i].bits;
      ++counts[best_i];
    }
  }
  out.widths.assign(m, 0);
  for (size_t p = 0; p < active; ++p) out.widths[order[p]] = static_cast<uint8_t>(hull[level[p]].width);
  out.bits_per_coord = (used + kFixedBitsPerSuperGroup * m) / static_cast<double>(num_elements);
  return out;
}

std::vector<double> StepBudgets(absl::Span<const std::vector<double>> energies, absl::Span<const size_t> num_elements,
                                double bits_per_coord, double min_bits, double max_bits, BitAllocator allocator,
                                const WidthErrors& errors) {
  const size_t buckets = energies.size();
  DQ_CHECK(num_elements.size() == buckets);
  DQ_CHECK(min_bits <= max_bits);
  double total_elements = 0;
  for (size_t k = 0; k < buckets; ++k) {
    DQ_CHECK(num_elements[k] > 0);
    total_elements += static_cast<double>(num_elements[k]);
  }
  std::vector<double> share(buckets, std::clamp(bits_per_coord, min_bits, max_bits));
  std::vector<bool> clamped(buckets, false);
  // Each round clamps at least one more bucket or ends, so at most buckets + 1 rounds.
  for (size_t round = 0; round <= buckets; ++round) {
    std::vector<double> joint;
    size_t joint_elements = 0;
    double budget = bits_per_coord * total_elements;
    for (size_t k = 0; k < buckets; ++k) {
      if (clamped[k]) {
        budget -= share[k] * static_cast<double>(num_elements[k]);
      } else {
        joint.insert(joint.end(), energies[k].begin(), energies[k].end());
        joint_elements += num_elements[k];
      }
    }
    if (joint_elements == 0) break;
    const Allocation a =
        AllocateWidths(joint, joint_elements, budget / static_cast<double>(joint_elements), allocator, errors);
    size_t pos = 0;
    for (size_t k = 0; k < buckets; ++k) {
      if (clamped[k]) continue;
      double bits = 0;
      for (size_t j = 0; j < energies[k].size(); ++j) {
        bits += kFixedBitsPerSuperGroup + SuperGroupPayloadBits(a.widths[pos + j]);
      }
      pos += energies[k].size();
      share[k] = bits / static_cast<double>(num_elements[k]);
    }
    bool changed = false;
    for (size_t k = 0; k < buckets; ++k) {
      if (clamped[k] || (share[k] >= min_bits && share[k] <= max_bits)) continue;
      share[k] = std::clamp(share[k], min_bits, max_bits);
      clamped[k] = changed = true;
    }
    if (!changed) break;
  }
  return share;
}

}  // namespace dynamiq::kernels
