#include "bench/synthetic_gradients.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "absl/strings/str_cat.h"

#include "kernels/random_math.h"

namespace dynamiq::bench {
namespace {

using kernels::RandomBits;
using kernels::StreamKey;

double Unit(uint32_t key, uint32_t i) { return (RandomBits(key, i) + 0.5) / 4294967296.0; }

double Normal(uint32_t key, uint32_t i) {
  return std::sqrt(-2.0 * std::log(Unit(key, 2 * i))) * std::cos(6.283185307179586 * Unit(key, 2 * i + 1));
}

}  // namespace

std::vector<std::vector<float>> SyntheticGradients(const SyntheticOptions& o) {
  const uint32_t magnitude_key = StreamKey(o.seed, 0, 1);
  const uint32_t shared_key = StreamKey(o.seed, 2 * o.step, 2);
  std::vector<uint32_t> worker_keys(o.workers);
  for (int w = 0; w < o.workers; ++w) worker_keys[w] = StreamKey(o.seed, 2 * o.step + 1, 100 + w);
  std::vector<std::vector<float>> out(o.workers, std::vector<float>(o.elements));
  const double a = std::sqrt(o.correlation), b = std::sqrt(1.0 - o.correlation);
  for (size_t begin = 0; begin < o.elements; begin += 256) {
    const uint32_t sg = static_cast<uint32_t>(begin / 256);
    const bool small = Unit(magnitude_key, 3 * sg) < 0.21;
    const double z = Normal(magnitude_key, 3 * sg + 1);
    const double scale = (small ? std::exp(-16.41 + 4.63 * z) : std::exp(-3.99 + o.magnitude_sigma * z)) / 16.0;
    for (size_t k = begin; k < std::min(o.elements, begin + 256); ++k) {
      const double shared = Normal(shared_key, static_cast<uint32_t>(k));
      for (int w = 0; w < o.workers; ++w) {
        out[w][k] = static_cast<float>(scale * (a * shared + b * Normal(worker_keys[w], static_cast<uint32_t>(k))));
      }
    }
  }
  return out;
}

std::vector<double> ExactSum(const std::vector<std::vector<float>>& inputs) {
  std::vector<double> sum(inputs[0].size(), 0.0);
  for (const auto& v : inputs) {
    for (size_t k = 0; k < v.size(); ++k) sum[k] += v[k];
  }
  return sum;
}

double Vnmse(const float* approx, absl::Span<const double> exact) {
  double err = 0, norm = 0;
  for (size_t k = 0; k < exact.size(); ++k) {
    const double d = approx[k] - exact[k];
    err += d * d;
    norm += exact[k] * exact[k];
  }
  return norm > 0 ? err / norm : (err > 0 ? INFINITY : 0.0);
}

double Median(std::vector<double> samples) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const size_t m = samples.size() / 2;
  return samples.size() % 2 ? samples[m] : (samples[m - 1] + samples[m]) / 2;
}

double Percentile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const size_t k = static_cast<size_t>(p / 100.0 * static_cast<double>(samples.size()));
  return samples[std::min(k, samples.size() - 1)];
}

absl::StatusOr<std::vector<std::vector<float>>> ReadFloatFiles(const std::vector<std::string>& paths) {
  std::vector<std::vector<float>> out;
  for (const std::string& path : paths) {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    if (!f) return absl::NotFoundError(absl::StrCat("cannot open --input file ", path));
    const std::streamsize bytes = f.tellg();
    if (bytes <= 0 || bytes % 4 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", bytes, " bytes is not a float32 array"));
    }
    std::vector<float> v(bytes / 4);
    f.seekg(0);
    f.read(reinterpret_cast<char*>(v.data()), bytes);
    if (!out.empty() && v.size() != out[0].size()) {
      return absl::InvalidArgumentError(absl::StrCat(path, " holds ", v.size(), " floats, ", paths[0], " holds ",
                                                     out[0].size(), "; all workers need the same size"));
    }
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace dynamiq::bench
