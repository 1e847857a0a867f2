// dynamiq-kernels-bench: single-core GB/s (of fp32 input) of the DynamiQ CPU codec per code width,
// so kernel changes can be measured width by width (dynamiq-bench codec mixes widths through the
// bit allocator). Every super-group of the chunk gets the same width (the plan bypasses the
// allocator); the data is Gaussian with a log-normal scale per super-group. Prints, per width,
// the best and the median of --reps repetitions of compress, decompress and fused DAR; per bit
// budget also the bucket statistics (ComputeStats) and the plan (MakePlan), per GB of input.
// With --threads N, then the scaling of one call split across 1..N threads (kernels/parallel_codec.h)
// at the first budget of --bits, in wall-clock GB/s.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "bench/synthetic_gradients.h"
#include "common/thread_pool.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/cpu/dynamiq_simd.h"
#include "kernels/parallel_codec.h"
#include "kernels/random_math.h"

ABSL_FLAG(int64_t, size, 1 << 20, "Elements per chunk.");
ABSL_FLAG(double, min_time, 0.1, "Seconds per measurement.");
ABSL_FLAG(int, reps, 5, "Repetitions per measurement (best and median are printed).");
ABSL_FLAG(std::string, levels, "auto", "DynamiQ levels: auto, mee or uniform.");
ABSL_FLAG(bool, scalar, false, "Time the scalar reference kernels instead of the SIMD ones.");
ABSL_FLAG(std::vector<std::string>, widths, std::vector<std::string>({"2", "3", "4", "5", "6", "7", "8"}),
          "Code widths to measure (comma-separated, 2..8).");
ABSL_FLAG(std::vector<std::string>, bits, std::vector<std::string>({"4", "5", "6"}),
          "Bit budgets for the rows measured as `dynamiq-bench codec` does (its synthetic data, 8 workers, the "
          "allocator's mix of widths); empty for none.");
ABSL_FLAG(int, threads, 1,
          "Also measure one call split across 1..threads threads (wall clock), at the first budget of --bits "
          "(5 if empty); 1: no scaling table.");
ABSL_FLAG(bool, cpu_time, true,
          "Time with this thread's CPU clock (robust when other processes share the cores) instead of the wall "
          "clock.");

namespace dynamiq::bench {
namespace {

using namespace dynamiq::kernels;  // NOLINT: a benchmark of this one module

std::vector<float> Data(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  const uint32_t key = StreamKey(seed, 0, 0);
  float scale = 1.0f;
  for (size_t i = 0; i < n; ++i) {
    if (i % kSuperGroupSize == 0) scale = std::exp(static_cast<float>(RandomBits(key, ~i) >> 8) / 16777216.0f * 8 - 6);
    const double u1 = (RandomBits(key, 2 * i) + 0.5) / 4294967296.0;
    const double u2 = (RandomBits(key, 2 * i + 1) + 0.5) / 4294967296.0;
    v[i] = scale * static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  return v;
}

double Seconds(bool wall_clock) {
  if (wall_clock || !absl::GetFlag(FLAGS_cpu_time)) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Seconds per call of fn: best and median of `reps` timings of at least `min_time` each (on the wall
// clock when `wall_clock`, else as --cpu_time says).
template <typename Fn>
std::pair<double, double> Time(Fn&& fn, bool wall_clock = false) {
  std::vector<double> t;
  fn();
  for (int r = 0; r < absl::GetFlag(FLAGS_reps); ++r) {
    int calls = 0;
    const double start = Seconds(wall_clock);
    double elapsed = 0;
    do {
      fn();
      ++calls;
      elapsed = Seconds(wall_clock) - start;
    } while (elapsed < absl::GetFlag(FLAGS_min_time));
    t.push_back(elapsed / calls);
  }
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2]};
}

// Compress, decompress and DAR of one chunk: best and median GB/s (of fp32 input) each.
struct Rates {
  std::pair<double, double> compress, decompress, dar;
};

bool Measure(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
             const Source& neighbour, const Dest& dest, Rates& rates, bool wall_clock = false) {
  std::vector<uint8_t> in(codec.MaxEncodedBytes(plan, chunk)), out(in.size());
  if (!codec.Compress(plan, chunk, neighbour, absl::MakeSpan(in)).ok()) return false;
  bool ok = true;
  const double gb = 4.0 * chunk.count / 1e9;
  auto rate = [gb](std::pair<double, double> t) { return std::make_pair(gb / t.first, gb / t.second); };
  rates.compress = rate(Time([&] { ok &= codec.Compress(plan, chunk, local, absl::MakeSpan(out)).ok(); }, wall_clock));
  rates.decompress = rate(Time([&] { ok &= codec.Decompress(plan, chunk, in, dest).ok(); }, wall_clock));
  rates.dar =
      rate(Time([&] { ok &= codec.DecompressAccumulateRecompress(plan, chunk, in, local, absl::MakeSpan(out)).ok(); },
                wall_clock));
  return ok;
}

// One chunk of `d` elements at `budget` bits (dynamiq-bench codec's data and allocated widths), its
// work split across 1..max_threads threads: wall-clock GB/s and the speedup over one thread.
int MeasureScaling(const CodecConfig& config, DynamiqCodec::Kernel kernel, size_t d, double budget, int max_threads) {
  CodecConfig budget_config = config;
  budget_config.bits = budget;
  const DynamiqCodec codec(budget_config, kernel);
  SyntheticOptions synthetic;
  synthetic.elements = d;
  const std::vector<std::vector<float>> workers = SyntheticGradients(synthetic);
  const Source raw{workers[0].data(), DType::kFloat32, 0, nullptr};
  std::vector<float> stats(codec.StatsLength(d)), out_values(d);
  codec.ComputeStats(raw, d, stats.data());
  auto plan = codec.MakePlan(RoundInfo{7, 0, 8}, d, stats, stats);
  if (!plan.ok()) return 1;
  Source w0 = raw, w1{workers[1].data(), DType::kFloat32, 0, nullptr};
  w0.subtract_per_group = w1.subtract_per_group = plan->local_means.data();
  const Dest dest{out_values.data(), DType::kFloat32, 0, nullptr};
  std::printf(
      "# scaling: one %zu-element chunk at %g bits split across threads (wall-clock GB/s, best / median; "
      "x: best over 1 thread)\n",
      d, budget);
  std::printf("%7s %15s %6s %15s %6s %15s %6s %15s %6s\n", "threads", "compress", "x", "decompress", "x", "DAR", "x",
              "stats", "x");
  Rates one;
  double one_stats = 0;
  const double gb = 4.0 * static_cast<double>(d) / 1e9;
  for (int t = 1; t <= max_threads; ++t) {
    common::ThreadPool pool(t);
    const ParallelCodec parallel(codec, &pool);
    Rates r;
    if (!Measure(parallel, *plan, ChunkRef{0, 0, d}, w0, w1, dest, r, /*wall_clock=*/true)) return 1;
    const auto stats_time = Time([&] { parallel.ComputeStats(raw, d, stats.data()); }, /*wall_clock=*/true);
    const std::pair<double, double> s{gb / stats_time.first, gb / stats_time.second};
    if (t == 1) {
      one = r;
      one_stats = s.first;
    }
    std::printf("%7d %7.2f /%6.2f %6.2f %7.2f /%6.2f %6.2f %7.2f /%6.2f %6.2f %7.2f /%6.2f %6.2f\n", t,
                r.compress.first, r.compress.second, r.compress.first / one.compress.first, r.decompress.first,
                r.decompress.second, r.decompress.first / one.decompress.first, r.dar.first, r.dar.second,
                r.dar.first / one.dar.first, s.first, s.second, s.first / one_stats);
  }
  return 0;
}

void PrintRow(const char* label, const char* levels, const Rates& r) {
  std::printf("%5s %7s %7.2f /%6.2f %7.2f /%6.2f %7.2f /%6.2f\n", label, levels, r.compress.first, r.compress.second,
              r.decompress.first, r.decompress.second, r.dar.first, r.dar.second);
}

int Run() {
  const size_t d = static_cast<size_t>(absl::GetFlag(FLAGS_size));
  CodecConfig config;
  const std::string levels = absl::GetFlag(FLAGS_levels);
  config.levels = levels == "mee" ? LevelKind::kMee : levels == "uniform" ? LevelKind::kUniform : LevelKind::kAuto;
  const DynamiqCodec codec(config,
                           absl::GetFlag(FLAGS_scalar) ? DynamiqCodec::Kernel::kScalar : DynamiqCodec::Kernel::kSimd);
  const std::vector<float> x = Data(d, 1), y = Data(d, 2);
  std::vector<float> means((d + kSuperGroupSize - 1) / kSuperGroupSize, 0.01f), out_values(d);
  const Source local{x.data(), DType::kFloat32, 0, means.data()};
  const Source neighbour{y.data(), DType::kFloat32, 0, means.data()};
  const Dest dest{out_values.data(), DType::kFloat32, 0, nullptr};
  const ChunkRef chunk{0, 0, d, 1, 8, 0};  // correlated rounding as on a butterfly
  std::printf("# %zu elements, %s kernels (%s), %s levels; GB/s of fp32 input per %s second, best / median of %d\n", d,
              absl::GetFlag(FLAGS_scalar) ? "scalar" : "SIMD", DynamiqSimdTarget(), levels.c_str(),
              absl::GetFlag(FLAGS_cpu_time) ? "CPU" : "wall-clock", absl::GetFlag(FLAGS_reps));
  std::printf("%5s %7s %15s %15s %15s\n", "width", "levels", "compress", "decompress", "DAR");
  for (const std::string& width : absl::GetFlag(FLAGS_widths)) {
    const int w = std::atoi(width.c_str());
    if (w < kMinWidth || w > kMaxWidth) {
      std::fprintf(stderr, "--widths: %s is not a width 2..8\n", width.c_str());
      return 2;
    }
    BucketPlan plan;
    plan.round = RoundInfo{5, 0, 8};
    plan.num_elements = d;
    plan.widths.assign(means.size(), static_cast<uint8_t>(w));
    Rates rates;
    if (!Measure(codec, plan, chunk, local, neighbour, dest, rates)) return 1;
    PrintRow(width.c_str(), codec.table(w).uniform ? "uniform" : "MEE", rates);
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  if (threads < 1 || threads > 256) {
    std::fprintf(stderr, "--threads must be in [1, 256], got %d\n", threads);
    return 2;
  }
  const DynamiqCodec::Kernel kernel =
      absl::GetFlag(FLAGS_scalar) ? DynamiqCodec::Kernel::kScalar : DynamiqCodec::Kernel::kSimd;
  if (absl::GetFlag(FLAGS_bits).empty()) {
    return threads > 1 ? MeasureScaling(config, kernel, d, 5.0, threads) : 0;
  }
  // As MeasureThroughput in bench/codec_bench.cc: worker 0 compresses, DAR adds worker 1's message.
  SyntheticOptions synthetic;
  synthetic.elements = d;
  const std::vector<std::vector<float>> workers = SyntheticGradients(synthetic);
  std::printf("# dynamiq-bench codec's setup: synthetic data, allocated widths; the row label is the budget\n");
  for (const std::string& budget : absl::GetFlag(FLAGS_bits)) {
    CodecConfig budget_config = config;
    budget_config.bits = std::atof(budget.c_str());
    const DynamiqCodec budget_codec(
        budget_config, absl::GetFlag(FLAGS_scalar) ? DynamiqCodec::Kernel::kScalar : DynamiqCodec::Kernel::kSimd);
    Source w0{workers[0].data(), DType::kFloat32, 0, nullptr}, w1{workers[1].data(), DType::kFloat32, 0, nullptr};
    std::vector<float> stats(budget_codec.StatsLength(d));
    budget_codec.ComputeStats(w0, d, stats.data());
    auto plan = budget_codec.MakePlan(RoundInfo{7, 0, 8}, d, stats, stats);
    if (!plan.ok()) return 1;
    w0.subtract_per_group = w1.subtract_per_group = plan->local_means.data();
    Rates rates;
    if (!Measure(budget_codec, *plan, ChunkRef{0, 0, d}, w0, w1, dest, rates)) return 1;
    PrintRow(budget.c_str(), "b", rates);
    // What every rank does once per bucket before any chunk moves: statistics, then the plan.
    const double gb = 4.0 * static_cast<double>(d) / 1e9;
    const Source raw{workers[0].data(), DType::kFloat32, 0, nullptr};
    const auto stats_time = Time([&] { budget_codec.ComputeStats(raw, d, stats.data()); });
    bool planned = true;
    const auto plan_time = Time([&] { planned &= budget_codec.MakePlan(RoundInfo{7, 0, 8}, d, stats, stats).ok(); });
    if (!planned) return 1;
    std::printf("%5s %7s stats %7.2f /%6.2f  plan %7.2f /%6.2f\n", budget.c_str(), "b", gb / stats_time.first,
                gb / stats_time.second, gb / plan_time.first, gb / plan_time.second);
  }
  if (threads > 1) return MeasureScaling(config, kernel, d, std::atof(absl::GetFlag(FLAGS_bits)[0].c_str()), threads);
  return 0;
}

}  // namespace
}  // namespace dynamiq::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "dynamiq-kernels-bench [--size=N] [--min_time=S] [--reps=R] [--widths=2,5] [--levels=auto|mee|uniform] "
      "[--bits=4,5,6] [--scalar] [--cpu_time=false] [--threads=N]: "
      "single-core GB/s of DynamiQ compress, decompress and fused DAR at each fixed code width 2..8, and at "
      "the bit budgets --bits as dynamiq-bench codec measures them; with --threads, the scaling of one call "
      "split across 1..N threads.");
  absl::ParseCommandLine(argc, argv);
  return dynamiq::bench::Run();
}
