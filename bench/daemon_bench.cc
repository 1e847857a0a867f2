// dynamiq-daemon-bench: what dynamiqd costs on top of the engine. Everything runs in this process
// (daemons, workers, engine ranks), over loopback:
//   overhead  2 daemons (2 nodes), 1 worker thread each through the client library (Unix socket +
//             shared memory), all-reduce of --size floats, versus the engine alone (2 threads,
//             Gloo over loopback, engine::AllReduce) with the same size, codec and topology; the two
//             take turns --rounds times.
//   latency   1 daemon, 2 local workers, 1024-float (4 KiB) all-reduces: median and p99
//             submit-to-complete microseconds, through the submission rings (the default) and
//             through one AllReduce call each; and 2 daemons (2 nodes) with 1 worker each.
//   memory    1 daemon, 2 local workers: VmRSS before and after --soak_ops small and large
//             all-reduces.
//   sweep     1 daemon, 2 local workers, all-reduces from --sweep_min_bytes to --sweep_max_bytes
//             (x4 each step): median and p99 submit-to-complete microseconds and GB/s per size (the
//             daemon's side of `dynamiq-bench sweep`; not in the default --sections).
// Every loop is bounded by a flag; every wait by --timeout.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/synthetic_gradients.h"
#include "dynamiq/client.h"
#include "engine/allreduce.h"
#include "engine/gloo_transport.h"
#include "engine/store.h"
#include "kernels/codec_registry.h"
#include "server/daemon.h"
#include "server/job.h"

ABSL_FLAG(int64_t, size, int64_t{16} << 20, "overhead: floats per all-reduce (default 16M = 64 MiB).");
ABSL_FLAG(std::string, codec, "dynamiq", "Codec of the job and of the engine run (none, bf16, dynamiq, ...).");
ABSL_FLAG(double, bits, 5, "Codec bits (dynamiq: average bits/coord incl. metadata, 3..8).");
ABSL_FLAG(std::string, topology, "ring", "ring or butterfly.");
ABSL_FLAG(uint64_t, min_compress_elements, 4096, "Tensors with fewer elements go uncompressed (as dynamiqd).");
ABSL_FLAG(int, iterations, 5, "overhead: timed all-reduces per path (the median is reported).");
ABSL_FLAG(int, warmup, 1, "overhead: untimed all-reduces per path first.");
ABSL_FLAG(int, rounds, 3, "overhead: the engine and the daemon path take turns this many times.");
ABSL_FLAG(int, latency_ops, 2000, "latency: timed 4 KiB all-reduces per worker.");
ABSL_FLAG(int, soak_ops, 2000, "memory: all-reduces per worker, alternating small (1024 floats) and large.");
ABSL_FLAG(int64_t, soak_large, int64_t{1} << 20, "memory: floats of the large soak all-reduce.");
ABSL_FLAG(int64_t, sweep_min_bytes, 8, "sweep: smallest all-reduce, fp32 bytes per worker.");
ABSL_FLAG(int64_t, sweep_max_bytes, int64_t{64} << 20, "sweep: largest all-reduce, fp32 bytes per worker.");
ABSL_FLAG(std::string, sections, "overhead,latency,memory", "Comma-separated sections to run (also: sweep).");
ABSL_FLAG(double, timeout, 120, "Seconds before a daemon start, rendezvous or collective fails.");
ABSL_FLAG(bool, json, false, "Print one JSON object per line instead of a table.");

namespace {

using dynamiq::Buffer;
using dynamiq::Client;
using dynamiq::ClientOptions;
using dynamiq::DType;
using dynamiq::bench::Median;
using dynamiq::bench::Percentile;
using dynamiq::server::Daemon;
using dynamiq::server::DaemonOptions;
using dynamiq::server::JobConfig;

// Scratch directory for worker sockets, removed on destruction.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/dqdbench-XXXXXX";
    const char* p = mkdtemp(tmpl);
    path_ = p ? p : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

absl::Duration Timeout() { return absl::Seconds(absl::GetFlag(FLAGS_timeout)); }

DaemonOptions MakeDaemonOptions(const std::string& dir, uint32_t rank, uint32_t nodes, const std::string& coordinator,
                                const JobConfig& config) {
  DaemonOptions o;
  o.node_rank = rank;
  o.num_nodes = nodes;
  o.coordinator = coordinator;
  o.listen = "127.0.0.1:0";
  o.worker_socket = absl::StrCat(dir, "/node", rank, ".sock");
  o.default_config = config;
  o.timeout = Timeout();
  return o;
}

absl::StatusOr<Client> ConnectWorker(const std::string& socket, uint32_t rank, uint32_t size, bool ring = true) {
  ClientOptions o;
  o.submission_ring = ring;
  o.socket_path = socket;
  o.job_id = "bench";
  o.local_rank = rank;
  o.local_world_size = size;
  o.timeout = Timeout();
  return Client::Connect(o);
}

std::vector<float> Gradients(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// VmRSS / RssAnon of this process in KiB (0 when /proc is unavailable).
struct Rss {
  double vm_kib = 0, anon_kib = 0;
};
Rss ReadRss() {
  Rss r;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) r.vm_kib = std::atof(line.c_str() + 6);
    if (line.rfind("RssAnon:", 0) == 0) r.anon_kib = std::atof(line.c_str() + 8);
  }
  return r;
}

// First error of a group of threads.
class Errors {
 public:
  void Add(const absl::Status& s) {
    if (s.ok()) return;
    absl::MutexLock lock(&mu_);
    if (first_.ok()) first_ = s;
  }
  absl::Status first() {
    absl::MutexLock lock(&mu_);
    return first_;
  }

 private:
  absl::Mutex mu_;
  absl::Status first_;
};

// ---- overhead ----------------------------------------------------------------------------------

// Per-iteration seconds (the slower rank of each iteration) of the engine alone.
absl::StatusOr<std::vector<double>> EngineAlone(const JobConfig& config, size_t n, int warmup, int iterations) {
  dynamiq::engine::InMemoryStore base;
  dynamiq::engine::PrefixStore store("bench/engine", base);
  std::vector<std::vector<float>> inputs = {Gradients(n, 1), Gradients(n, 2)};
  std::vector<std::vector<double>> times(2, std::vector<double>(iterations, 0));
  std::barrier sync(2);
  std::atomic<bool> failed{false};
  Errors errors;
  auto rank_main = [&](int rank) {
    dynamiq::engine::GlooTransportOptions to;
    to.hostname = "127.0.0.1";
    to.timeout = Timeout();
    auto transport = dynamiq::engine::ConnectGlooTransport(store, rank, 2, to);
    absl::StatusOr<std::unique_ptr<dynamiq::kernels::Codec>> codec = dynamiq::kernels::CreateCodec(config.codec);
    if (!transport.ok()) errors.Add(transport.status());
    if (!codec.ok()) errors.Add(codec.status());
    if (!transport.ok() || !codec.ok()) failed = true;
    std::vector<float> work(n);
    dynamiq::engine::BufferPool buffers;  // as the daemon's job keeps one
    for (int i = 0; i < warmup + iterations; ++i) {
      std::copy(inputs[rank].begin(), inputs[rank].end(), work.begin());
      sync.arrive_and_wait();
      if (failed) return;  // both ranks see the flag after the same barrier
      dynamiq::engine::AllReduceOptions o;
      o.topology = config.topology;
      o.job_id = 1;
      o.sequence = static_cast<uint64_t>(i);
      o.timeout = Timeout();
      o.buffers = &buffers;
      const absl::Time t0 = absl::Now();
      auto r = dynamiq::engine::AllReduce(**codec, **transport, o,
                                          {work.data(), dynamiq::kernels::DType::kFloat32, 0, nullptr},
                                          {work.data(), dynamiq::kernels::DType::kFloat32, 0, nullptr}, n);
      const double s = absl::ToDoubleSeconds(absl::Now() - t0);
      if (!r.ok()) {
        errors.Add(r.status());
        failed = true;
      }
      if (i >= warmup) times[rank][i - warmup] = s;
      sync.arrive_and_wait();
      if (failed) return;
    }
  };
  std::thread t0(rank_main, 0), t1(rank_main, 1);
  t0.join();
  t1.join();
  if (!errors.first().ok()) return errors.first();
  std::vector<double> out(iterations);
  for (int i = 0; i < iterations; ++i) out[i] = std::max(times[0][i], times[1][i]);
  return out;
}

// Starts a 2-node cluster on loopback (node 0 is the coordinator).
absl::Status StartTwoNodes(const std::string& dir, const JobConfig& config, std::unique_ptr<Daemon>* node0,
                           std::unique_ptr<Daemon>* node1) {
  *node0 = std::make_unique<Daemon>(MakeDaemonOptions(dir, 0, 2, "", config));
  absl::Status s0, s1;
  Daemon* d0 = node0->get();
  std::thread start0([&] { s0 = d0->Start(); });  // blocks until node 1 joins
  const absl::Time deadline = absl::Now() + Timeout();
  while (d0->listen_address().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  if (d0->listen_address().empty()) {
    d0->Shutdown(absl::ZeroDuration());
    start0.join();
    return absl::DeadlineExceededError("node 0 did not bind its listen address");
  }
  *node1 = std::make_unique<Daemon>(MakeDaemonOptions(dir, 1, 2, d0->listen_address(), config));
  s1 = (*node1)->Start();
  if (!s1.ok()) d0->Shutdown(absl::ZeroDuration());  // unblock node 0's Start
  start0.join();
  if (!s1.ok()) return s1;
  return s0;
}

absl::StatusOr<std::vector<double>> ThroughDaemons(const JobConfig& config, size_t n, int warmup, int iterations) {
  TempDir temp;
  if (temp.path().empty()) return absl::InternalError("mkdtemp failed");
  std::unique_ptr<Daemon> node0, node1;
  absl::Status started = StartTwoNodes(temp.path(), config, &node0, &node1);
  if (!started.ok()) {
    if (node1) node1->Shutdown(absl::ZeroDuration());
    if (node0) node0->Shutdown(absl::ZeroDuration());
    return started;
  }
  std::vector<std::vector<float>> inputs = {Gradients(n, 1), Gradients(n, 2)};
  std::vector<std::vector<double>> times(2, std::vector<double>(iterations, 0));
  std::barrier sync(2);
  std::atomic<bool> failed{false};
  Errors errors;
  auto worker_main = [&](int node) {
    absl::StatusOr<Client> client = ConnectWorker(absl::StrCat(temp.path(), "/node", node, ".sock"), 0, 1);
    absl::StatusOr<Buffer> buffer = absl::InternalError("not connected");
    if (client.ok()) buffer = client->Allocate(n * sizeof(float));
    if (!client.ok()) errors.Add(client.status());
    if (client.ok() && !buffer.ok()) errors.Add(buffer.status());
    if (!buffer.ok()) failed = true;
    for (int i = 0; i < warmup + iterations; ++i) {
      if (!failed) std::memcpy(buffer->data(), inputs[node].data(), n * sizeof(float));
      sync.arrive_and_wait();
      if (failed) break;
      const absl::Time t0 = absl::Now();
      absl::Status s = client->AllReduce(*buffer, 0, n, DType::kFloat32, "grad");
      const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
      if (!s.ok()) {
        errors.Add(s);
        failed = true;
      }
      if (i >= warmup) times[node][i - warmup] = secs;
      sync.arrive_and_wait();
      if (failed) break;
    }
    if (buffer.ok()) buffer->Release().IgnoreError();
  };
  std::thread w0(worker_main, 0), w1(worker_main, 1);
  w0.join();
  w1.join();
  node1->Shutdown();
  node0->Shutdown();
  if (!errors.first().ok()) return errors.first();
  std::vector<double> out(iterations);
  for (int i = 0; i < iterations; ++i) out[i] = std::max(times[0][i], times[1][i]);
  return out;
}

// ---- single-daemon sections ----------------------------------------------------------------------

// Runs `body(rank, client)` on 2 worker threads of one single-node daemon. `ring`: the workers
// submit through their submission rings (else one AllReduce call each).
template <typename Body>
absl::Status WithOneDaemon(const JobConfig& config, Body body, bool ring = true) {
  TempDir temp;
  if (temp.path().empty()) return absl::InternalError("mkdtemp failed");
  Daemon daemon(MakeDaemonOptions(temp.path(), 0, 1, "", config));
  if (absl::Status s = daemon.Start(); !s.ok()) return s;
  Errors errors;
  auto worker_main = [&](int rank) {
    absl::StatusOr<Client> client = ConnectWorker(temp.path() + "/node0.sock", rank, 2, ring);
    if (client.ok() && client->uses_submission_ring() != ring) {
      client = absl::InternalError(absl::StrCat("the worker ", ring ? "got no" : "got a", " submission ring"));
    }
    if (!client.ok()) {
      errors.Add(client.status());
      body(rank, nullptr, errors);  // still takes part in the barriers
      return;
    }
    body(rank, &*client, errors);
  };
  std::thread w0(worker_main, 0), w1(worker_main, 1);
  w0.join();
  w1.join();
  daemon.Shutdown();
  return errors.first();
}

struct LatencyResult {
  double median_us = 0, p99_us = 0, mean_us = 0;
  size_t samples = 0;
};

absl::StatusOr<LatencyResult> Latency(const JobConfig& config, int ops, bool ring) {
  constexpr size_t kFloats = 1024;
  constexpr int kWarmup = 20;
  std::vector<std::vector<double>> us(2);
  std::barrier sync(2);
  std::atomic<bool> failed{false};
  absl::Status s = WithOneDaemon(
      config,
      [&](int rank, Client* client, Errors& errors) {
        absl::StatusOr<Buffer> buffer = absl::InternalError("not connected");
        if (client) buffer = client->Allocate(kFloats * sizeof(float));
        if (client && !buffer.ok()) errors.Add(buffer.status());
        if (!buffer.ok()) failed = true;
        sync.arrive_and_wait();
        if (failed) return;
        std::fill_n(static_cast<float*>(buffer->data()), kFloats, 1e-3f * static_cast<float>(rank + 1));
        us[rank].reserve(ops);
        for (int i = 0; i < kWarmup + ops; ++i) {
          const absl::Time t0 = absl::Now();
          absl::Status st = client->AllReduce(*buffer, 0, kFloats, DType::kFloat32, "small", /*average=*/true);
          const double d = absl::ToDoubleMicroseconds(absl::Now() - t0);
          if (!st.ok()) {
            errors.Add(st);
            failed = true;
            break;  // the peer's pending collective fails at the daemon's timeout
          }
          if (i >= kWarmup) us[rank].push_back(d);
        }
        buffer->Release().IgnoreError();
      },
      ring);
  if (!s.ok()) return s;
  std::vector<double> all = us[0];
  all.insert(all.end(), us[1].begin(), us[1].end());
  LatencyResult r;
  r.samples = all.size();
  r.median_us = Median(all);
  r.p99_us = Percentile(all, 99);
  for (double x : all) r.mean_us += x / static_cast<double>(std::max<size_t>(all.size(), 1));
  return r;
}

struct SweepRow {
  size_t elements = 0;
  int ops = 0;  // per worker
  double median_us = 0, p99_us = 0;
};

// Each size's ops: many for small sizes, fewer as they grow (about 256 MiB per size and worker).
int SweepOps(size_t bytes) {
  return static_cast<int>(std::clamp<double>(256.0 * (1 << 20) / static_cast<double>(bytes), 5, 200));
}

absl::StatusOr<std::vector<SweepRow>> Sweep(const JobConfig& config, size_t min_elements, size_t max_elements) {
  constexpr int kWarmup = 3;
  std::vector<size_t> sizes;
  for (size_t e = min_elements; e <= max_elements; e *= 4) {
    sizes.push_back(e);
    if (e > max_elements / 4) break;
  }
  std::vector<std::vector<std::vector<double>>> us(2, std::vector<std::vector<double>>(sizes.size()));
  std::barrier sync(2);
  std::atomic<bool> failed{false};
  absl::Status s = WithOneDaemon(config, [&](int rank, Client* client, Errors& errors) {
    absl::StatusOr<Buffer> buffer = absl::InternalError("not connected");
    if (client) buffer = client->Allocate(max_elements * sizeof(float));
    if (client && !buffer.ok()) errors.Add(buffer.status());
    if (!buffer.ok()) failed = true;
    for (size_t k = 0; k < sizes.size(); ++k) {
      sync.arrive_and_wait();  // both workers start each size together
      if (failed) return;
      std::fill_n(static_cast<float*>(buffer->data()), sizes[k], 1e-3f * static_cast<float>(rank + 1));
      const int ops = SweepOps(sizes[k] * sizeof(float));
      for (int i = 0; i < kWarmup + ops; ++i) {
        const absl::Time t0 = absl::Now();
        absl::Status st = client->AllReduce(*buffer, 0, sizes[k], DType::kFloat32, absl::StrCat("sweep", k),
                                            /*average=*/true);
        const double d = absl::ToDoubleMicroseconds(absl::Now() - t0);
        if (!st.ok()) {
          errors.Add(st);
          failed = true;
          break;  // the peer's pending collective fails at the daemon's timeout
        }
        if (i >= kWarmup) us[rank][k].push_back(d);
      }
    }
    if (buffer.ok()) buffer->Release().IgnoreError();
  });
  if (!s.ok()) return s;
  std::vector<SweepRow> rows;
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<double> all = us[0][k];
    all.insert(all.end(), us[1][k].begin(), us[1][k].end());
    SweepRow r;
    r.elements = sizes[k];
    r.ops = SweepOps(sizes[k] * sizeof(float));
    r.median_us = Median(all);
    r.p99_us = Percentile(all, 99);
    rows.push_back(r);
  }
  return rows;
}

struct MemoryResult {
  Rss start, before, after;
  int ops = 0;
  size_t registered_bytes = 0;  // shared memory the two workers registered
};

absl::StatusOr<MemoryResult> Memory(const JobConfig& config, int ops, size_t large) {
  constexpr size_t kSmall = 1024;
  constexpr int kWarmup = 10;
  MemoryResult r;
  r.start = ReadRss();
  r.ops = ops;
  r.registered_bytes = 2 * (kSmall + large) * sizeof(float);
  std::barrier sync(2);
  std::atomic<bool> failed{false};
  absl::Status s = WithOneDaemon(config, [&](int rank, Client* client, Errors& errors) {
    absl::StatusOr<Buffer> small = absl::InternalError("not connected");
    absl::StatusOr<Buffer> big = absl::InternalError("not connected");
    if (client) small = client->Allocate(kSmall * sizeof(float));
    if (client && small.ok()) big = client->Allocate(large * sizeof(float));
    if (client && !small.ok()) errors.Add(small.status());
    if (client && small.ok() && !big.ok()) errors.Add(big.status());
    if (!small.ok() || !big.ok()) failed = true;
    sync.arrive_and_wait();
    if (failed) return;
    std::fill_n(static_cast<float*>(small->data()), kSmall, 1e-3f);
    std::fill_n(static_cast<float*>(big->data()), large, 1e-3f);
    auto run = [&](int count) {
      for (int i = 0; i < count && !failed; ++i) {
        const bool is_large = i % 2 == 1;
        absl::Status st = is_large ? client->AllReduce(*big, 0, large, DType::kFloat32, "large", true)
                                   : client->AllReduce(*small, 0, kSmall, DType::kFloat32, "small", true);
        if (!st.ok()) {
          errors.Add(st);
          failed = true;
        }
      }
    };
    run(kWarmup);  // maps and touches everything the steady state uses
    sync.arrive_and_wait();
    if (rank == 0) r.before = ReadRss();
    sync.arrive_and_wait();
    run(ops);
    sync.arrive_and_wait();
    if (rank == 0) r.after = ReadRss();
    small->Release().IgnoreError();
    big->Release().IgnoreError();
  });
  if (!s.ok()) return s;
  return r;
}

bool HasSection(const std::string& name) {
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sections), ',')) {
    if (s == name) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) {
    return absl::EndsWith(path, "bench/daemon_bench.cc");
  };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "dynamiqd's overhead over the engine alone (2 in-process daemons on loopback, 1 "
      "worker each, --size floats, --codec/--bits), small all-reduce latency (1 daemon, 2 workers, 4 KiB, "
      "--latency_ops; through the submission rings and through calls) and memory growth over --soak_ops all-reduces "
      "(VmRSS).\n"
      "Usage: dynamiq-daemon-bench [--size=N] [--codec=dynamiq --bits=5] [--iterations=5] [--rounds=3] "
      "[--latency_ops=2000] [--soak_ops=2000] [--sections=overhead,latency,memory[,sweep]] [--json]");
  absl::ParseCommandLine(argc, argv);
  const bool json = absl::GetFlag(FLAGS_json);
  auto config = dynamiq::server::MakeJobConfig(absl::GetFlag(FLAGS_codec), absl::GetFlag(FLAGS_bits),
                                               absl::GetFlag(FLAGS_topology),
                                               absl::GetFlag(FLAGS_min_compress_elements), "measured");
  if (!config.ok()) {
    std::fprintf(stderr, "bad compression settings: %s\n", config.status().ToString().c_str());
    return 2;
  }
  const int64_t size = absl::GetFlag(FLAGS_size);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int warmup = std::max(0, absl::GetFlag(FLAGS_warmup));
  const int latency_ops = absl::GetFlag(FLAGS_latency_ops);
  const int soak_ops = absl::GetFlag(FLAGS_soak_ops);
  const int64_t soak_large = absl::GetFlag(FLAGS_soak_large);
  if (size <= 0 || iterations <= 0 || rounds <= 0 || latency_ops <= 0 || soak_ops < 0 || soak_large <= 0) {
    std::fprintf(stderr,
                 "--size, --iterations, --rounds, --latency_ops and --soak_large must be > 0, --soak_ops >= 0\n");
    return 2;
  }
  const std::string describe = dynamiq::server::DescribeJobConfig(*config);
  if (!json) std::printf("config: %s\n", describe.c_str());
  int rc = 0;

  if (HasSection("overhead")) {
    const size_t n = static_cast<size_t>(size);
    // The two paths take turns, --rounds times, so a slow spell of this machine (other processes,
    // frequency) falls on both instead of deciding the comparison; medians over all rounds.
    absl::Status failed;
    std::vector<double> engine_times, daemon_times;
    for (int round = 0; round < rounds && failed.ok(); ++round) {
      auto engine = EngineAlone(*config, n, warmup, iterations);
      auto daemon = engine.ok() ? ThroughDaemons(*config, n, warmup, iterations) : engine;
      if (!engine.ok() || !daemon.ok()) {
        failed = (!engine.ok() ? engine : daemon).status();
        break;
      }
      engine_times.insert(engine_times.end(), engine->begin(), engine->end());
      daemon_times.insert(daemon_times.end(), daemon->begin(), daemon->end());
    }
    if (!failed.ok()) {
      std::fprintf(stderr, "overhead: %s\n", failed.ToString().c_str());
      rc = 1;
    } else {
      const double e = Median(engine_times), d = Median(daemon_times);
      const double pct = e > 0 ? (d / e - 1) * 100 : 0;
      const double mib = static_cast<double>(n) * 4 / (1 << 20);
      if (json) {
        std::printf(
            "{\"section\":\"overhead\",\"codec\":\"%s\",\"bits\":%g,\"topology\":\"%s\",\"elements\":%zu,"
            "\"iterations\":%d,\"rounds\":%d,\"engine_median_s\":%.6f,\"daemon_median_s\":%.6f,\"overhead_pct\":%.2f,"
            "\"target_pct\":10,\"within_target\":%s}\n",
            absl::GetFlag(FLAGS_codec).c_str(), absl::GetFlag(FLAGS_bits), absl::GetFlag(FLAGS_topology).c_str(), n,
            iterations, rounds, e, d, pct, pct <= 10 ? "true" : "false");
      } else {
        std::printf("\n[overhead] 2 nodes x 1 worker, %zu floats (%.1f MiB), median of %d (%d rounds of %d)\n", n, mib,
                    rounds * iterations, rounds, iterations);
        std::printf("  %-28s %12s %12s\n", "path", "median ms", "GB/s (alg)");
        std::printf("  %-28s %12.2f %12.3f\n", "engine alone (Gloo)", e * 1e3, n * 4 / e / 1e9);
        std::printf("  %-28s %12.2f %12.3f\n", "daemon + client library", d * 1e3, n * 4 / d / 1e9);
        std::printf("  overhead: %+.1f%% (target <= 10%%: %s)\n", pct, pct <= 10 ? "met" : "NOT met");
      }
    }
    std::fflush(stdout);
  }

  if (HasSection("latency")) {
    if (!json) std::printf("\n[latency] 1 daemon, 2 workers, 1024 floats (4 KiB), %d ops per worker\n", latency_ops);
    for (bool ring : {true, false}) {
      const char* path = ring ? "ring" : "calls";
      auto lat = Latency(*config, latency_ops, ring);
      if (!lat.ok()) {
        std::fprintf(stderr, "latency (%s): %s\n", path, lat.status().ToString().c_str());
        rc = 1;
      } else if (json) {
        std::printf(
            "{\"section\":\"latency\",\"path\":\"%s\",\"elements\":1024,\"workers\":2,\"ops\":%d,\"samples\":%zu,"
            "\"median_us\":%.1f,\"p99_us\":%.1f,\"mean_us\":%.1f}\n",
            path, latency_ops, lat->samples, lat->median_us, lat->p99_us, lat->mean_us);
      } else {
        std::printf("  %-36s median %.1f us, p99 %.1f us, mean %.1f us (%zu samples)\n",
                    ring ? "submission ring (the default):" : "one AllReduce call each:", lat->median_us, lat->p99_us,
                    lat->mean_us, lat->samples);
      }
    }
    // Across nodes: 2 in-process daemons over loopback (the daemons' default transport), one
    // worker each; per collective the slower node's submit-to-complete.
    auto two = ThroughDaemons(*config, 1024, 20, latency_ops);
    if (!two.ok()) {
      std::fprintf(stderr, "latency (2 nodes): %s\n", two.status().ToString().c_str());
      rc = 1;
    } else {
      std::vector<double> us;
      for (double seconds : *two) us.push_back(seconds * 1e6);
      if (json) {
        std::printf(
            "{\"section\":\"latency\",\"path\":\"2 nodes\",\"elements\":1024,\"workers\":2,\"ops\":%d,"
            "\"samples\":%zu,\"median_us\":%.1f,\"p99_us\":%.1f}\n",
            latency_ops, us.size(), Median(us), Percentile(us, 99));
      } else {
        std::printf("  %-36s median %.1f us, p99 %.1f us (%zu samples)\n", "2 nodes x 1 worker (loopback):", Median(us),
                    Percentile(us, 99), us.size());
      }
    }
    std::fflush(stdout);
  }

  if (HasSection("sweep")) {
    const size_t lo = static_cast<size_t>(std::max<int64_t>(4, absl::GetFlag(FLAGS_sweep_min_bytes))) / 4;
    const size_t hi = std::max(lo, static_cast<size_t>(std::max<int64_t>(4, absl::GetFlag(FLAGS_sweep_max_bytes))) / 4);
    auto rows = Sweep(*config, lo, hi);
    if (!rows.ok()) {
      std::fprintf(stderr, "sweep: %s\n", rows.status().ToString().c_str());
      rc = 1;
    } else {
      if (!json) {
        std::printf("\n[sweep] 1 daemon, 2 workers, submit-to-complete per all-reduce\n");
        std::printf("  %12s %11s %6s %11s %11s %9s\n", "bytes", "elements", "ops", "median_us", "p99_us", "GB/s");
      }
      for (const SweepRow& r : *rows) {
        const double gbps = static_cast<double>(r.elements) * 4 / (r.median_us * 1e-6) / 1e9;
        if (json) {
          std::printf(
              "{\"section\":\"sweep\",\"bytes\":%zu,\"elements\":%zu,\"workers\":2,\"ops\":%d,\"median_us\":%.1f,"
              "\"p99_us\":%.1f,\"algbw_GBps\":%.4f}\n",
              r.elements * 4, r.elements, r.ops, r.median_us, r.p99_us, gbps);
        } else {
          std::printf("  %12zu %11zu %6d %11.1f %11.1f %9.4f\n", r.elements * 4, r.elements, r.ops, r.median_us,
                      r.p99_us, gbps);
        }
      }
    }
    std::fflush(stdout);
  }

  if (HasSection("memory")) {
    auto mem = Memory(*config, soak_ops, static_cast<size_t>(soak_large));
    if (!mem.ok()) {
      std::fprintf(stderr, "memory: %s\n", mem.status().ToString().c_str());
      rc = 1;
    } else {
      const double before = mem->before.vm_kib / 1024, after = mem->after.vm_kib / 1024;
      const double anon_growth = (mem->after.anon_kib - mem->before.anon_kib) / 1024;
      const double shm = static_cast<double>(mem->registered_bytes) / (1 << 20);
      if (json) {
        std::printf(
            "{\"section\":\"memory\",\"ops\":%d,\"small_elements\":1024,\"large_elements\":%lld,"
            "\"registered_shm_mib\":%.2f,\"rss_start_mib\":%.1f,\"rss_before_mib\":%.1f,\"rss_after_mib\":%.1f,"
            "\"rss_growth_mib\":%.2f,\"anon_growth_mib\":%.2f}\n",
            mem->ops, static_cast<long long>(soak_large), shm, mem->start.vm_kib / 1024, before, after, after - before,
            anon_growth);
      } else {
        std::printf("\n[memory] 1 daemon, 2 workers, %d ops per worker alternating 1024 and %lld floats\n", mem->ops,
                    static_cast<long long>(soak_large));
        std::printf(
            "  VmRSS: start %.1f MiB, before soak %.1f MiB, after %.1f MiB -> growth %+.2f MiB "
            "(RssAnon %+.2f MiB; registered shm %.2f MiB)\n",
            mem->start.vm_kib / 1024, before, after, after - before, anon_growth, shm);
      }
    }
    std::fflush(stdout);
  }
  return rc;
}
