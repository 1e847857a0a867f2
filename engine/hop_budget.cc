#include "engine/hop_budget.h"

#include <algorithm>
#include <cmath>

#include "kernels/codec.h"

namespace dynamiq::engine {
namespace {

constexpr size_t kSg = 256;  // kernels' super-group (DynamiQ's centring granularity)

double Centred(absl::Span<const std::vector<float>> inputs, absl::Span<const float> subtract, int r, size_t i) {
  return static_cast<double>(inputs[r][i]) - (subtract.empty() ? 0.0 : static_cast<double>(subtract[i / kSg]));
}

}  // namespace

HopMessages CountHopMessages(const Schedule& schedule) {
  const int n = schedule.world_size;
  HopMessages h;
  h.compressions.assign(n, 0);
  h.messages.assign(n, 0);
  if (n == 1) {
    h.compressions[0] = h.messages[0] = 1;
    return h;
  }
  std::vector<std::vector<int>> summands(n, std::vector<int>(n, 1));  // [rank][chunk]
  for (const std::vector<Transfer>& step : schedule.reduce_scatter) {
    std::vector<int> sent;
    for (const Transfer& t : step) {
      const int k = summands[t.from][t.chunk];
      ++h.compressions[k - 1];
      ++h.messages[k - 1];
      sent.push_back(k);
    }
    for (size_t i = 0; i < step.size(); ++i) summands[step[i].to][step[i].chunk] += sent[i];
  }
  for (int c = 0; c < n; ++c) {
    const int k = summands[schedule.owner[c]][c];
    ++h.compressions[k - 1];
    h.messages[k - 1] += n - 1;
  }
  return h;
}

std::vector<double> HopEnergies(const Schedule& schedule, size_t d, absl::Span<const std::vector<float>> inputs,
                                absl::Span<const float> subtract) {
  const int n = schedule.world_size;
  std::vector<double> sum(n, 0.0);
  std::vector<int> count(n, 0);
  auto energy = [](const std::vector<double>& v) {
    double e = 0;
    for (double x : v) e += x * x;
    return e;
  };
  for (int c = 0; c < n; ++c) {
    const kernels::ChunkRef chunk = ChunkOf(d, n, c);
    std::vector<std::vector<double>> acc(n);  // empty until the rank first holds chunk c
    std::vector<int> summands(n, 1);
    auto start = [&](int r) {
      if (!acc[r].empty() || chunk.count == 0) return;
      acc[r].resize(chunk.count);
      for (size_t i = 0; i < chunk.count; ++i) acc[r][i] = Centred(inputs, subtract, r, chunk.begin + i);
    };
    for (const std::vector<Transfer>& step : schedule.reduce_scatter) {
      for (const Transfer& t : step) {
        if (t.chunk != c) continue;
        start(t.from);
        start(t.to);
        const int k = summands[t.from];
        sum[k - 1] += energy(acc[t.from]);
        ++count[k - 1];
        for (size_t i = 0; i < acc[t.from].size(); ++i) acc[t.to][i] += acc[t.from][i];
        summands[t.to] += k;
        acc[t.from].clear();
      }
    }
    const int owner = schedule.owner[c];
    start(owner);
    sum[summands[owner] - 1] += energy(acc[owner]);
    ++count[summands[owner] - 1];
  }
  for (int k = 0; k < n; ++k) sum[k] = count[k] > 0 ? sum[k] / count[k] : 0.0;
  return sum;
}

std::vector<double> HopEnergyModel(int n, double rho) {
  std::vector<double> e(n);
  for (int k = 1; k <= n; ++k) e[k - 1] = k + static_cast<double>(k) * (k - 1) * rho;
  return e;
}

double RankCorrelation(size_t d, absl::Span<const std::vector<float>> inputs, absl::Span<const float> subtract) {
  const int n = static_cast<int>(inputs.size());
  if (n < 2) return 0;
  double each = 0, total = 0;
  for (size_t i = 0; i < d; ++i) {
    double s = 0;
    for (int r = 0; r < n; ++r) {
      const double x = Centred(inputs, subtract, r, i);
      each += x * x;
      s += x;
    }
    total += s * s;
  }
  if (each <= 0) return 0;
  return std::clamp((total / each - 1) / (n - 1), -1.0 / (n - 1), 1.0);
}

std::vector<double> HopBudgets(const HopMessages& hops, absl::Span<const double> energies, double mean_bits,
                               double min_bits, double max_bits, double tilt) {
  const size_t n = hops.compressions.size();
  std::vector<double> bits(n, mean_bits);
  // b̄_k = clamp(C + a_k); a k with zero energy sits at min_bits whatever C is.
  std::vector<double> a(n, 0.0);
  std::vector<bool> zero(n, false);
  double wire = 0;
  for (size_t k = 0; k < n; ++k) {
    if (hops.compressions[k] == 0) continue;
    wire += hops.messages[k];
    if (!(energies[k] > 0)) {
      zero[k] = true;
      continue;
    }
    a[k] = 0.5 * tilt * std::log2(hops.compressions[k] * energies[k] / hops.messages[k]);
  }
  if (wire == 0) return bits;
  auto fill = [&](double c) {
    double cost = 0;
    for (size_t k = 0; k < n; ++k) {
      if (hops.compressions[k] == 0) continue;
      bits[k] = zero[k] ? min_bits : std::clamp(c + a[k], min_bits, max_bits);
      cost += hops.messages[k] * bits[k];
    }
    return cost / wire;
  };
  // The mean cost is non-decreasing in C; every a_k lies within [lo - min_bits, hi - max_bits] of C's range.
  double lo = min_bits, hi = max_bits;
  for (size_t k = 0; k < n; ++k) {
    lo = std::min(lo, min_bits - a[k]);
    hi = std::max(hi, max_bits - a[k]);
  }
  if (fill(lo) >= mean_bits) return bits;
  if (fill(hi) <= mean_bits) return bits;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (fill(mid) < mean_bits ? lo : hi) = mid;
  }
  fill(0.5 * (lo + hi));
  return bits;
}

}  // namespace dynamiq::engine
