#include "bench/sweep_bench.h"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "bench/synthetic_gradients.h"
#include "common/status_macros.h"
#include "engine/allreduce.h"
#include "engine/host_transport.h"
#include "engine/store.h"
#include "kernels/codec_info.h"
#include "kernels/codec_registry.h"

namespace dynamiq::bench {
namespace {

// Input bytes per point the iteration count aims at (so a point takes about as long as another).
constexpr double kBytesPerPoint = 256.0 * (1 << 20);

int IterationsFor(const SweepOptions& o, size_t bytes) {
  const double wanted = kBytesPerPoint / static_cast<double>(std::max<size_t>(bytes, 1));
  return static_cast<int>(std::clamp<double>(wanted, o.min_iterations, o.max_iterations));
}

struct PointSpec {
  const kernels::CodecConfig* codec;
  engine::Topology topology;
  std::string topology_name;
  size_t elements;
  int iterations;
};

}  // namespace

absl::StatusOr<std::vector<SweepPoint>> RunSweep(const SweepOptions& o,
                                                 const std::function<void(const SweepPoint&)>& on_point) {
  const int n = o.world_size;
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("ranks must be >= 1, got ", n));
  if (o.factor < 2) return absl::InvalidArgumentError(absl::StrCat("--factor must be >= 2, got ", o.factor));
  if (o.min_iterations < 1 || o.max_iterations < o.min_iterations || o.warmup < 0) {
    return absl::InvalidArgumentError("iterations: need 1 <= min_iterations <= max_iterations and warmup >= 0");
  }
  if (o.codecs.empty() || o.topologies.empty()) return absl::InvalidArgumentError("no codec or no schedule to run");
  const size_t min_elements = std::max<size_t>(1, o.min_bytes / sizeof(float));
  const size_t max_elements = std::max(min_elements, o.max_bytes / sizeof(float));

  // The points, in the order every rank runs them.
  std::vector<PointSpec> points;
  for (const kernels::CodecConfig& codec : o.codecs) {
    for (const std::string& name : o.topologies) {
      DQ_ASSIGN_OR_RETURN(engine::Topology topology, engine::ParseTopology(name));
      for (size_t e = min_elements; e <= max_elements; e *= static_cast<size_t>(o.factor)) {
        points.push_back({&codec, topology, name, e, IterationsFor(o, e * sizeof(float))});
        if (e > max_elements / static_cast<size_t>(o.factor)) break;  // the next step would overflow the range
      }
    }
  }
  SyntheticOptions data;
  data.workers = n;
  data.elements = max_elements;
  data.seed = o.seed;
  const std::vector<std::vector<float>> inputs = SyntheticGradients(data);
  const std::vector<double> exact = ExactSum(inputs);

  engine::InMemoryStore store;
  std::vector<std::unique_ptr<engine::Transport>> transports(n);
  std::vector<absl::Status> errors(n);
  {
    std::vector<std::thread> connecting;
    for (int r = 0; r < n; ++r) {
      connecting.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<engine::Transport>> t =
            engine::ConnectHostTransport(o.transport, store, r, n, "127.0.0.1", o.timeout);
        if (t.ok()) {
          transports[r] = *std::move(t);
        } else {
          errors[r] = t.status();
        }
      });
    }
    for (std::thread& t : connecting) t.join();
  }
  for (const absl::Status& e : errors) DQ_RETURN_IF_ERROR(e);

  // seconds[point][iteration][rank]
  std::vector<std::vector<std::vector<double>>> seconds(points.size());
  for (size_t p = 0; p < points.size(); ++p) {
    seconds[p].assign(points[p].iterations, std::vector<double>(n, 0.0));
  }
  std::vector<uint64_t> wire(points.size(), 0);
  std::vector<double> vnmse(points.size(), 0.0);
  std::atomic<bool> failed{false};
  absl::Mutex error_mu;
  absl::Status first_error;
  std::barrier sync(n);
  std::vector<SweepPoint> results;
  auto make_point = [&](size_t p) {
    const PointSpec& spec = points[p];
    std::vector<double> slowest;
    for (const std::vector<double>& per_rank : seconds[p]) {
      slowest.push_back(*std::max_element(per_rank.begin(), per_rank.end()));
    }
    SweepPoint point;
    point.codec = std::string(kernels::CodecName(spec.codec->id));
    point.bits = kernels::GetCodecInfo(spec.codec->id).default_bits > 0 ? spec.codec->bits : 0;
    point.topology = spec.topology_name;
    point.elements = spec.elements;
    point.bytes = spec.elements * sizeof(float);
    point.iterations = spec.iterations;
    const double median = Median(slowest);
    point.median_us = median * 1e6;
    point.p99_us = Percentile(slowest, 99) * 1e6;
    point.algbw_gbps = static_cast<double>(point.bytes) / median / 1e9;
    point.busbw_gbps = point.algbw_gbps * (n > 1 ? 2.0 * (n - 1) / n : 1.0);
    point.wire_bytes_per_rank = wire[p];
    point.vnmse = vnmse[p];
    return point;
  };
  auto rank_main = [&](int rank) {
    engine::BufferPool buffers;  // as a daemon's job reuses its message buffers
    std::vector<float> out(max_elements);
    uint64_t sequence = 0;
    std::unique_ptr<kernels::Codec> codec;
    const kernels::CodecConfig* codec_config = nullptr;
    for (size_t p = 0; p < points.size(); ++p) {
      const PointSpec& spec = points[p];
      if (codec_config != spec.codec) {
        absl::StatusOr<std::unique_ptr<kernels::Codec>> made = kernels::CreateCodec(*spec.codec);
        if (!made.ok()) {
          absl::MutexLock lock(&error_mu);
          if (first_error.ok()) first_error = made.status();
          failed = true;
        } else {
          codec = *std::move(made);
        }
        codec_config = spec.codec;
      }
      for (int it = -o.warmup; it < spec.iterations; ++it) {
        sync.arrive_and_wait();  // the ranks start each all-reduce together
        if (failed) return;      // every rank sees it after the same barrier
        engine::AllReduceOptions ar;
        ar.topology = spec.topology;
        ar.sequence = sequence++;
        ar.timeout = o.timeout;
        ar.block_elements = o.block_elements;
        ar.buffers = &buffers;
        const absl::Time start = absl::Now();
        absl::StatusOr<engine::AllReduceResult> r = engine::AllReduce(
            *codec, *transports[rank], ar, {inputs[rank].data(), kernels::DType::kFloat32, 0, nullptr},
            {out.data(), kernels::DType::kFloat32, 0, nullptr}, spec.elements);
        const double t = absl::ToDoubleSeconds(absl::Now() - start);
        if (!r.ok()) {
          {
            absl::MutexLock lock(&error_mu);
            if (first_error.ok()) {
              first_error = absl::Status(r.status().code(), absl::StrCat("rank ", rank, ", ", spec.elements,
                                                                         " elements: ", r.status().message()));
            }
          }
          failed = true;
          for (auto& tr : transports) tr->Abort();  // the other ranks stop waiting for this one
          continue;
        }
        if (it >= 0) seconds[p][it][rank] = t;
        if (rank == 0) wire[p] = r->bytes_sent;
      }
      // Every rank's times are in: rank 0 reports the point while the others wait at the next one.
      sync.arrive_and_wait();
      if (rank == 0 && !failed) {
        vnmse[p] = Vnmse(out.data(), absl::MakeConstSpan(exact).first(spec.elements));
        results.push_back(make_point(p));
        if (on_point) on_point(results.back());
      }
    }
  };
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) ranks.emplace_back(rank_main, r);
  for (std::thread& t : ranks) t.join();
  if (failed) return first_error;
  return results;
}

std::string FormatSweepJson(const SweepPoint& p, const SweepOptions& o) {
  return absl::StrFormat(
      R"({"codec":"%s","bits":%g,"topology":"%s","world_size":%d,"transport":"%s","bytes":%d,"elements":%d,)"
      R"("iterations":%d,"median_us":%.2f,"p99_us":%.2f,"algbw_GBps":%.4f,"busbw_GBps":%.4f,)"
      R"("wire_bytes_per_rank":%d,"vnmse":%.6g})",
      p.codec, p.bits, p.topology, o.world_size, o.transport, p.bytes, p.elements, p.iterations, p.median_us, p.p99_us,
      p.algbw_gbps, p.busbw_gbps, p.wire_bytes_per_rank, p.vnmse);
}

std::string SweepTableHeader() {
  return absl::StrFormat("%-12s %5s %-9s %12s %11s %6s %11s %11s %9s %9s %12s %10s", "codec", "bits", "schedule",
                         "bytes", "elements", "iters", "median_us", "p99_us", "algbw", "busbw", "wire_B/rank", "vnmse");
}

std::string FormatSweepRow(const SweepPoint& p) {
  return absl::StrFormat("%-12s %5g %-9s %12d %11d %6d %11.1f %11.1f %9.4f %9.4f %12d %10.3g", p.codec, p.bits,
                         p.topology, p.bytes, p.elements, p.iterations, p.median_us, p.p99_us, p.algbw_gbps,
                         p.busbw_gbps, p.wire_bytes_per_rank, p.vnmse);
}

}  // namespace dynamiq::bench
