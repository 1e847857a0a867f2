// dynamiq-bench: benchmarks. Subcommands:
//   codec      compression error and single-core speed of every codec on a simulated multi-hop
//              all-reduce (bench/codec_bench.h).
//   allreduce  one rank of a compressed all-reduce between processes over Gloo TCP
//              (bench/allreduce_bench.h); scripts/bench-network runs n of them in namespaces.
//   step-budget one DynamiQ bit budget per training step: each bucket's share of it, from the
//              step's per-rank bucket files (bench/codec_bench.h, kernels::StepBudgets).
//   controller error-budget compression in closed loop on the simulated all-reduce, with a
//              gradient shift mid-run (bench/controller_sim.h); per-step CSV or JSON.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/allreduce_bench.h"
#include "bench/codec_bench.h"
#include "bench/controller_sim.h"
#include "bench/sweep_bench.h"
#include "common/secret_file.h"
#include "common/thread_pool.h"
#include "kernels/codec.h"

ABSL_FLAG(std::string, codec, "all",
          "Comma-separated codecs: none,bf16,dynamiq,mxfp8,mxfp6,mxfp4,thc,uniform,int8,global_qsgd,arc_topk,flash, or "
          "'all'. int8 is INTELLECT-1's codec for DiLoCo pseudo-gradients (per-chunk +-6 sigma clip, 8 bits): on "
          "per-step gradients it clips their heavy tail (vNMSE ~0.3; docs/compressors.md).");
ABSL_FLAG(std::string, bits, "",
          "Comma-separated bit budgets for the codecs that take one: dynamiq (average bits/coord incl. metadata, "
          "3..8; default 5), uniform and flash (bits per code, 2..8; default 4) and global_qsgd (bits per leaf code, "
          "2..8; 2^(b-1)-1 levels per sign; default 8), and arc_topk's density (fraction of 256-element rows kept, "
          "0.001..1; default 0.1). Each value is a row.");
ABSL_FLAG(std::string, allocator, "measured",
          "DynamiQ bit allocator: measured (ours: minimises measured error), paper (the paper's 4x-per-bit "
          "thresholds), or both.");
ABSL_FLAG(std::string, levels, "auto",
          "DynamiQ levels: auto (per width, whichever has lower measured error: MEE at 4 bits, uniform at 8), "
          "mee (the paper's non-uniform levels at every width) or uniform.");
ABSL_FLAG(bool, correlated, true, "Correlated (stratified) rounding across ranks for dynamiq and uniform.");
ABSL_FLAG(int, workers, 8, "Simulated ranks.");
ABSL_FLAG(std::string, topology, "ring",
          "ring, butterfly (power-of-two --workers) or two_shot (all-to-all reduce-scatter and all-gather, one step "
          "each).");
ABSL_FLAG(int64_t, size, 1 << 22, "Elements per worker (synthetic data).");
ABSL_FLAG(std::string, input, "",
          "Comma-separated raw little-endian float32 files, one per worker (codec) or rank (allreduce: every rank "
          "reads all of them, for the exact sum), to measure your own gradients "
          "(step-budget: one such list per bucket of the step, the lists separated by ';') "
          "instead of the synthetic data. Synthetic data: per 256-element super-group a log-normal mixture "
          "magnitude (DynamiQ paper, Table 7: .79 N(-3.99, 1.22), .21 N(-16.41, 4.63) in ln), times a normal "
          "value shared by all workers (share --correlation of the variance) plus a private normal value.");
ABSL_FLAG(double, correlation, 0.5, "Synthetic data: fraction of variance shared by all workers (0..1).");
ABSL_FLAG(uint64_t, seed, 1, "Synthetic data seed.");
ABSL_FLAG(int, trials, 3, "All-reduce trials averaged for vnmse and wire bits.");
ABSL_FLAG(double, min_time, 0.3, "Seconds per throughput measurement (0 skips throughput).");
ABSL_FLAG(bool, json, false, "Print one JSON object per line instead of a table.");
ABSL_FLAG(std::string, dump_output, "",
          "codec: write each row's all-reduced result (rank 0, last trial; raw float32) to "
          "<dump_output>.<row index>.bin, rows numbered from 0 in output order; DynamiQ rows also write "
          "rank 0's code width per super-group (one byte each) to <dump_output>.<row index>.widths.");
ABSL_FLAG(std::string, hop_bits, "",
          "codec: a DynamiQ b̄ per hop (engine/hop_budget.h, simulated non-fused): measured (the Lagrange rule on "
          "the data's partial-sum energies per summand count), model (on E_k = k + k(k-1) rho, rho from the data), "
          "each at the wire cost of --bits within 3..8; or --workers comma-separated b̄ values for partial sums of "
          "1..n summands (n: the owner's final sum, forwarded by the all-gather). Empty: one b̄ (the engines').");
ABSL_FLAG(double, hop_tilt, 1.0,
          "codec: with --hop_bits=measured|model, scale the rule's spread of b̄ (1: the rule, 0: one b̄).");
ABSL_FLAG(std::string, step_energy, "statistics",
          "step-budget: the per-super-group energy the split weighs: statistics (the square of the sum of the "
          "ranks' norms, what the allocator sees before an all-reduce) or result (the squared norm of the "
          "all-reduced sum, known after it, e.g. the previous step's).");
// allreduce
ABSL_FLAG(int, rank, 0, "allreduce: this process's rank.");
ABSL_FLAG(int, world_size, 1, "allreduce: number of ranks.");
ABSL_FLAG(std::string, store, "127.0.0.1:29500", "allreduce: host:port of the TCP rendezvous store.");
ABSL_FLAG(bool, serve_store, false, "allreduce: host the rendezvous store at --store (one rank, usually 0).");
ABSL_FLAG(std::string, hostname, "127.0.0.1", "allreduce: IP address this rank's transport binds to.");
ABSL_FLAG(std::string, transport, "gloo",
          "allreduce: gloo (Gloo's TCP transport, as dynamiqd uses) or tcp (engine/tcp_transport.h: plain TCP "
          "sockets, one connection per pair, no Gloo).");
ABSL_FLAG(int, iterations, 5, "allreduce: timed all-reduces (the median is reported).");
ABSL_FLAG(int, warmup, 1, "allreduce: untimed all-reduces first.");
ABSL_FLAG(double, timeout, 120, "allreduce: seconds before a rendezvous or collective fails.");
ABSL_FLAG(int64_t, block, 4 << 20, "allreduce: pipelining block in elements (0 = no pipelining).");
ABSL_FLAG(bool, timeline, false,
          "allreduce: the JSON line lists every timed iteration as [start, end] in Unix microseconds "
          "(timeline_unix_us).");
ABSL_FLAG(bool, time_breakdown, false,
          "allreduce: record where each timed all-reduce's time goes (codec work, checksums, waiting for "
          "the network; engine/timeline.h): the JSON line gets time_ms, the mean milliseconds per kind.");
ABSL_FLAG(std::string, trace_out, "",
          "allreduce: with --time_breakdown, write every timed iteration's spans to this file as a Chrome "
          "trace (chrome://tracing, Perfetto; one file per rank, opened together they line up).");
ABSL_FLAG(int, codec_threads, std::min(dynamiq::common::AvailableCpus(), dynamiq::common::kMaxPoolThreads),
          "allreduce: split each collective's codec work across this many threads (as dynamiqd --codec_threads, "
          "with its default: the CPUs this process may use; same results for any value).");
ABSL_FLAG(bool, balanced_chunks, false,
          "allreduce: size-balanced splitting: cut every block's chunks so that their encoded sizes, not their "
          "element counts, are equal (engine/block_plan.h BalancedChunks; all ranks must agree).");
ABSL_FLAG(double, lossy_phase_ms, 0,
          "allreduce: above 0, the loss-tolerant all-reduce over UDP datagrams (engine/lossy_all_reduce.h; codec "
          "none, bf16 or int8), each of its two phases ending this many ms after a rank's sends with what "
          "arrived; the "
          "ranks line up over --transport between iterations.");
ABSL_FLAG(double, udp_send_mbps, 0,
          "allreduce: with --lossy_phase_ms, pace each rank's datagrams to this many Mbit/s.");
ABSL_FLAG(bool, all_ranks_print, false, "allreduce: every rank prints its JSON line (default: rank 0 only).");
ABSL_FLAG(std::string, cluster_secret_file, "",
          "allreduce: authenticate every message with HMAC-SHA256 under a key derived from this secret file (as "
          "dynamiqd --cluster_secret_file; mode 0600); every rank needs the same file.");
// sweep (also --codec, --bits, --topology, --transport, --warmup, --iterations, --block, --timeout, --seed,
// --correlated, --json)
ABSL_FLAG(int, ranks, 2, "sweep: ranks, as threads of this process over loopback.");
ABSL_FLAG(int64_t, min_bytes, 8, "sweep: smallest all-reduce, fp32 bytes per rank.");
ABSL_FLAG(int64_t, max_bytes, int64_t{64} << 20, "sweep: largest all-reduce, fp32 bytes per rank.");
ABSL_FLAG(int, factor, 4, "sweep: size step (each size is this many times the last).");
ABSL_FLAG(int, min_iterations, 5, "sweep: fewest timed all-reduces per point (the largest sizes).");
// controller (also --workers, --topology, --seed, --correlation, --json)
ABSL_FLAG(int64_t, elements, 1 << 16, "controller: elements per rank (synthetic data).");
ABSL_FLAG(double, target_vnmse, 1e-3, "controller: the error budget (target vNMSE).");
ABSL_FLAG(double, min_bits, 3, "controller: lowest b̄ the controller may choose; step-budget: of a bucket.");
ABSL_FLAG(double, max_bits, 8, "controller: highest b̄ the controller may choose; step-budget: of a bucket.");
ABSL_FLAG(double, initial_bits, 5, "controller: b̄ of the first step.");
ABSL_FLAG(int, steps, 60, "controller: simulated training steps (one all-reduce each).");
ABSL_FLAG(int, shift_step, 20, "controller: the step at which the gradient distribution shifts.");
ABSL_FLAG(double, correlation_after, 0.5, "controller: --correlation after the shift.");
ABSL_FLAG(int, revert_step, -1, "controller: the step at which the data shifts back (-1: never).");
ABSL_FLAG(double, magnitude_sigma, 1.22,
          "controller: ln-sd of the per-super-group magnitudes before the shift (the synthetic data's 1.22).");
ABSL_FLAG(double, magnitude_sigma_after, 0.5,
          "controller: ln-sd of the magnitudes after the shift (narrower: the energy is spread over more "
          "super-groups and the error at a given b̄ grows, ~10x at 5 bits for 0.5).");
ABSL_FLAG(int, apply_delay, 2, "controller: steps a decision waits before it applies (dynamiqd: 2).");
ABSL_FLAG(bool, compare_fixed, true,
          "controller: also measure every fixed b̄ (quarter bits in [--min_bits, --max_bits]) on the same data and "
          "report in the summary line (starts with #; with --json an object with \"summary\":true) the smallest "
          "fixed b̄ that meets the target at every step.");

namespace {

using dynamiq::kernels::BitAllocator;
using dynamiq::kernels::CodecConfig;
using dynamiq::kernels::CodecId;

int Fail(const std::string& message) {
  std::fprintf(stderr, "dynamiq-bench: %s\n", message.c_str());
  return 2;
}

int RunCodec() {
  dynamiq::bench::CodecBenchOptions o;
  o.workers = absl::GetFlag(FLAGS_workers);
  o.topology = absl::GetFlag(FLAGS_topology);
  o.elements = static_cast<size_t>(absl::GetFlag(FLAGS_size));
  o.correlation = absl::GetFlag(FLAGS_correlation);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.trials = absl::GetFlag(FLAGS_trials);
  o.min_seconds = absl::GetFlag(FLAGS_min_time);
  o.output_prefix = absl::GetFlag(FLAGS_dump_output);
  o.hop_bits = absl::GetFlag(FLAGS_hop_bits);
  o.hop_tilt = absl::GetFlag(FLAGS_hop_tilt);
  if (o.workers < 1 || o.trials < 1 || absl::GetFlag(FLAGS_size) < 1) {
    return Fail("--workers, --trials and --size must be positive");
  }
  if (!absl::GetFlag(FLAGS_input).empty()) o.inputs = absl::StrSplit(absl::GetFlag(FLAGS_input), ',');

  std::vector<std::string> names = absl::StrSplit(absl::GetFlag(FLAGS_codec), ',');
  if (absl::GetFlag(FLAGS_codec) == "all") {
    names.clear();
    for (const dynamiq::kernels::CodecInfo& info : dynamiq::kernels::AllCodecs()) names.emplace_back(info.name);
  }
  std::vector<double> bits;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_bits), ',', absl::SkipEmpty())) {
    double v;
    if (!absl::SimpleAtod(b, &v)) return Fail(absl::StrCat("--bits: '", b, "' is not a number"));
    bits.push_back(v);
  }
  std::vector<BitAllocator> allocators;
  const std::string allocator = absl::GetFlag(FLAGS_allocator);
  if (allocator == "measured" || allocator == "both") allocators.push_back(BitAllocator::kMeasured);
  if (allocator == "paper" || allocator == "both") allocators.push_back(BitAllocator::kPaper);
  if (allocators.empty()) return Fail("--allocator must be measured, paper or both");
  const std::string levels = absl::GetFlag(FLAGS_levels);
  if (levels != "auto" && levels != "mee" && levels != "uniform") {
    return Fail("--levels must be auto, mee or uniform");
  }

  for (const std::string& name : names) {
    auto id = dynamiq::kernels::ParseCodecId(name);
    if (!id.ok()) return Fail(std::string(id.status().message()));
    CodecConfig c;
    c.id = *id;
    c.correlated_rounding = absl::GetFlag(FLAGS_correlated);
    c.levels = levels == "auto"  ? dynamiq::kernels::LevelKind::kAuto
               : levels == "mee" ? dynamiq::kernels::LevelKind::kMee
                                 : dynamiq::kernels::LevelKind::kUniform;
    const dynamiq::kernels::CodecInfo& info = dynamiq::kernels::GetCodecInfo(c.id);
    if (info.has_bits && info.min_bits < info.max_bits) {  // a bit setting to sweep
      std::vector<double> values = bits;
      if (values.empty()) values = {info.default_bits};
      for (BitAllocator a :
           c.id == CodecId::kDynamiq ? allocators : std::vector<BitAllocator>{BitAllocator::kMeasured}) {
        for (double v : values) {
          c.bits = v;
          c.allocator = a;
          o.configs.push_back(c);
        }
      }
    } else {
      c.bits = info.default_bits;  // thc: 4; codecs without a bit setting: 0
      o.configs.push_back(c);
    }
  }
  auto rows = dynamiq::bench::RunCodecBench(o);
  if (!rows.ok()) return Fail(std::string(rows.status().message()));
  if (absl::GetFlag(FLAGS_json)) {
    for (const auto& r : *rows) std::printf("%s\n", dynamiq::bench::FormatRowJson(r, o).c_str());
  } else {
    std::printf("%s", dynamiq::bench::FormatTable(*rows, o).c_str());
  }
  return 0;
}

int RunStepBudget() {
  std::vector<std::vector<std::string>> buckets;
  for (absl::string_view list : absl::StrSplit(absl::GetFlag(FLAGS_input), ';', absl::SkipEmpty())) {
    buckets.push_back(absl::StrSplit(list, ','));
  }
  if (buckets.empty())
    return Fail("step-budget needs --input: per bucket, one file per worker, buckets separated by ';'");
  std::vector<CodecConfig> configs;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_bits), ',', absl::SkipEmpty())) {
    CodecConfig c;
    if (!absl::SimpleAtod(b, &c.bits)) return Fail(absl::StrCat("--bits: '", b, "' is not a number"));
    configs.push_back(c);
  }
  if (configs.empty()) configs.push_back(CodecConfig{});
  const std::string allocator = absl::GetFlag(FLAGS_allocator), levels = absl::GetFlag(FLAGS_levels);
  if (allocator != "measured" && allocator != "paper") return Fail("--allocator must be measured or paper");
  if (levels != "auto" && levels != "mee" && levels != "uniform") return Fail("--levels must be auto, mee or uniform");
  for (CodecConfig& c : configs) {
    c.allocator = allocator == "paper" ? BitAllocator::kPaper : BitAllocator::kMeasured;
    c.levels = levels == "auto"  ? dynamiq::kernels::LevelKind::kAuto
               : levels == "mee" ? dynamiq::kernels::LevelKind::kMee
                                 : dynamiq::kernels::LevelKind::kUniform;
  }
  const std::string energy = absl::GetFlag(FLAGS_step_energy);
  if (energy != "statistics" && energy != "result") return Fail("--step_energy must be statistics or result");
  auto rows = dynamiq::bench::PlanStepBudgets(
      buckets, absl::GetFlag(FLAGS_workers), configs, absl::GetFlag(FLAGS_min_bits), absl::GetFlag(FLAGS_max_bits),
      energy == "result" ? dynamiq::bench::StepEnergy::kResult : dynamiq::bench::StepEnergy::kStatistics);
  if (!rows.ok()) return Fail(std::string(rows.status().message()));
  for (const auto& r : *rows) std::printf("%s\n", dynamiq::bench::FormatStepBudgetJson(r).c_str());
  return 0;
}

int RunAllReduce() {
  dynamiq::bench::AllReduceBenchOptions o;
  o.rank = absl::GetFlag(FLAGS_rank);
  o.world_size = absl::GetFlag(FLAGS_world_size);
  o.store = absl::GetFlag(FLAGS_store);
  o.serve_store = absl::GetFlag(FLAGS_serve_store);
  o.hostname = absl::GetFlag(FLAGS_hostname);
  o.transport = absl::GetFlag(FLAGS_transport);
  o.topology = absl::GetFlag(FLAGS_topology);
  o.elements = static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_size)));
  o.iterations = absl::GetFlag(FLAGS_iterations);
  o.warmup = absl::GetFlag(FLAGS_warmup);
  o.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  o.block_elements = static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_block)));
  o.seed = absl::GetFlag(FLAGS_seed);
  o.timeline = absl::GetFlag(FLAGS_timeline);
  o.time_breakdown = absl::GetFlag(FLAGS_time_breakdown) || !absl::GetFlag(FLAGS_trace_out).empty();
  o.trace_out = absl::GetFlag(FLAGS_trace_out);
  o.codec_threads = absl::GetFlag(FLAGS_codec_threads);
  o.balanced_chunks = absl::GetFlag(FLAGS_balanced_chunks);
  o.lossy_phase_ms = absl::GetFlag(FLAGS_lossy_phase_ms);
  o.udp_send_mbps = absl::GetFlag(FLAGS_udp_send_mbps);
  if (!absl::GetFlag(FLAGS_input).empty()) o.inputs = absl::StrSplit(absl::GetFlag(FLAGS_input), ',');
  if (!absl::GetFlag(FLAGS_cluster_secret_file).empty()) {
    auto secret = dynamiq::common::ReadSecret(absl::GetFlag(FLAGS_cluster_secret_file), "--cluster_secret_file");
    if (!secret.ok()) return Fail(std::string(secret.status().message()));
    o.cluster_secret = *std::move(secret);
  }
  auto id = dynamiq::kernels::ParseCodecId(absl::GetFlag(FLAGS_codec));
  if (!id.ok()) return Fail(absl::StrCat("--codec: ", id.status().message(), " (allreduce takes one codec)"));
  o.codec.id = *id;
  o.codec.correlated_rounding = absl::GetFlag(FLAGS_correlated);
  // The codec's default bit setting (dynamiq 5, uniform 4, thc 4, global_qsgd 8); 0 without one.
  double bits = dynamiq::kernels::GetCodecInfo(o.codec.id).default_bits;
  if (!absl::GetFlag(FLAGS_bits).empty() && !absl::SimpleAtod(absl::GetFlag(FLAGS_bits), &bits)) {
    return Fail("--bits: allreduce takes one number");
  }
  o.codec.bits = bits;
  auto result = dynamiq::bench::RunAllReduceBench(o);
  if (!result.ok()) return Fail(std::string(result.status().ToString()));
  if (o.rank == 0 || absl::GetFlag(FLAGS_all_ranks_print)) {
    std::printf("%s\n", dynamiq::bench::FormatAllReduceJson(*result, o).c_str());
  }
  return 0;
}

int RunSweep() {
  dynamiq::bench::SweepOptions o;
  o.world_size = absl::GetFlag(FLAGS_ranks);
  o.transport = absl::GetFlag(FLAGS_transport);
  o.topologies = absl::StrSplit(absl::GetFlag(FLAGS_topology), ',', absl::SkipEmpty());
  o.min_bytes = static_cast<size_t>(std::max<int64_t>(4, absl::GetFlag(FLAGS_min_bytes)));
  o.max_bytes = static_cast<size_t>(std::max<int64_t>(4, absl::GetFlag(FLAGS_max_bytes)));
  o.factor = absl::GetFlag(FLAGS_factor);
  o.min_iterations = absl::GetFlag(FLAGS_min_iterations);
  // --iterations' default (5) is allreduce's; a sweep's small sizes want more.
  o.max_iterations = std::max(absl::GetFlag(FLAGS_iterations), 50);
  o.warmup = absl::GetFlag(FLAGS_warmup);
  o.block_elements = static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_block)));
  o.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  o.seed = absl::GetFlag(FLAGS_seed);
  // "all" (the codec subcommand's default) is uncompressed and DynamiQ here.
  const std::string codecs = absl::GetFlag(FLAGS_codec) == "all" ? "none,dynamiq" : absl::GetFlag(FLAGS_codec);
  std::vector<double> bits;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_bits), ',', absl::SkipEmpty())) {
    double v = 0;
    if (!absl::SimpleAtod(b, &v)) return Fail(absl::StrCat("--bits: '", b, "' is not a number"));
    bits.push_back(v);
  }
  for (absl::string_view name : absl::StrSplit(codecs, ',', absl::SkipEmpty())) {
    auto id = dynamiq::kernels::ParseCodecId(name);
    if (!id.ok()) return Fail(absl::StrCat("--codec: ", id.status().message()));
    dynamiq::kernels::CodecConfig c;
    c.id = *id;
    c.correlated_rounding = absl::GetFlag(FLAGS_correlated);
    const double default_bits = dynamiq::kernels::GetCodecInfo(*id).default_bits;
    if (default_bits <= 0 || bits.empty()) {
      c.bits = default_bits;
      o.codecs.push_back(c);
    } else {
      for (double b : bits) {
        c.bits = b;
        o.codecs.push_back(c);
      }
    }
  }
  const bool json = absl::GetFlag(FLAGS_json);
  bool first = true;  // the table's header goes out with the first point (not before a refusal)
  auto result = dynamiq::bench::RunSweep(o, [&](const dynamiq::bench::SweepPoint& p) {
    if (first && !json) {
      std::printf("# dynamiq-bench sweep: %d ranks (threads) over %s on loopback, block %zu elements\n", o.world_size,
                  o.transport.c_str(), o.block_elements);
      std::printf("%s\n", dynamiq::bench::SweepTableHeader().c_str());
    }
    first = false;
    std::printf("%s\n",
                json ? dynamiq::bench::FormatSweepJson(p, o).c_str() : dynamiq::bench::FormatSweepRow(p).c_str());
    std::fflush(stdout);
  });
  if (!result.ok()) return Fail(std::string(result.status().ToString()));
  return 0;
}

int RunController() {
  dynamiq::bench::ControllerSimOptions o;
  o.ranks = absl::GetFlag(FLAGS_workers);
  o.elements = static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_elements)));
  o.topology = absl::GetFlag(FLAGS_topology);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.shift_step = absl::GetFlag(FLAGS_shift_step);
  o.correlation_before = absl::GetFlag(FLAGS_correlation);
  o.correlation_after = absl::GetFlag(FLAGS_correlation_after);
  o.revert_step = absl::GetFlag(FLAGS_revert_step);
  o.magnitude_sigma_before = absl::GetFlag(FLAGS_magnitude_sigma);
  o.magnitude_sigma_after = absl::GetFlag(FLAGS_magnitude_sigma_after);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.apply_delay = absl::GetFlag(FLAGS_apply_delay);
  o.initial_bits = absl::GetFlag(FLAGS_initial_bits);
  o.policy.target_vnmse = absl::GetFlag(FLAGS_target_vnmse);
  o.policy.min_bits = absl::GetFlag(FLAGS_min_bits);
  o.policy.max_bits = absl::GetFlag(FLAGS_max_bits);
  std::vector<double> grid;
  if (absl::GetFlag(FLAGS_compare_fixed)) {
    for (double b = o.policy.min_bits; b <= o.policy.max_bits + 1e-9; b += 0.25) grid.push_back(b);
  }
  auto result = dynamiq::bench::RunControllerSim(o, grid);
  if (!result.ok()) return Fail(std::string(result.status().message()));
  const std::vector<dynamiq::bench::SimStep>& steps = result->steps;
  std::printf("%s", absl::GetFlag(FLAGS_json) ? dynamiq::bench::FormatSimJson(steps, o).c_str()
                                              : dynamiq::bench::FormatSimCsv(steps, o).c_str());
  double mean_bits = 0, worst = 0;
  int over = 0;
  for (const auto& s : steps) {
    mean_bits += s.bits / steps.size();
    worst = std::max(worst, s.vnmse);
    over += s.vnmse > o.policy.target_vnmse;
  }
  std::string fixed = "(not measured)";
  if (absl::GetFlag(FLAGS_compare_fixed)) {
    const std::optional<double> best = dynamiq::bench::SmallestFixedBudgetMeeting(*result, o.policy.target_vnmse);
    fixed = best.has_value() ? absl::StrCat(*best) : "none within [min_bits, max_bits]";
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(R"({"summary":true,"mean_bits":%.4f,"steps_over_target":%d,"steps":%zu,"max_vnmse":%.6g,)"
                R"("best_fixed_bits":"%s"})"
                "\n",
                mean_bits, over, steps.size(), worst, fixed.c_str());
  } else {
    std::printf(
        "# controller: mean bits %.3f, steps over target %d of %zu, max vnmse %.3g; smallest fixed b̄ meeting "
        "the target at every step: %s\n",
        mean_bits, over, steps.size(), worst, fixed.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // --help lists the flags of this file (abseil matches on the program name otherwise).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) { return absl::EndsWith(path, "bench/main.cc"); };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "dynamiq benchmarks.\n"
      "  dynamiq-bench codec [flags]   compression error (vNMSE of the all-reduced sum), wire bits and "
      "single-core GB/s of compress, decompress and fused DAR, per codec, on a simulated ring or butterfly.\n"
      "  dynamiq-bench allreduce [flags] one rank of a compressed all-reduce over Gloo TCP; prints JSON "
      "(method, seconds = median, algbw/busbw on the uncompressed size, wire bytes per rank, vnmse).\n"
      "  dynamiq-bench sweep [flags]    an nccl-tests-style size sweep: --ranks ranks (threads over loopback "
      "--transport) all-reduce --min_bytes..--max_bytes (x --factor) per --codec, --bits and --topology (comma "
      "lists; --codec=all: none,dynamiq); per size the median and p99 microseconds of the slowest rank, algbw/busbw, "
      "wire bytes per rank and vnmse (a table, or --json lines).\n"
      "  dynamiq-bench controller [flags] error-budget compression in closed loop on the simulated all-reduce "
      "(--workers ranks, --elements per rank) with a gradient shift at --shift_step; prints per-step CSV (or --json): "
      "step, target, bits, vnmse, epoch, wire_bits, shifted, decision; then a # summary line.\n"
      "  dynamiq-bench step-budget [flags] one DynamiQ budget per step: each bucket's b̄ (JSON lines) when "
      "--bits is the step's average, from --input=<bucket 0 files>;<bucket 1 files>;...\n"
      "Example: dynamiq-bench codec --codec=dynamiq,mxfp8 --bits=4,5,6 --workers=8 --topology=ring\n"
      "Example: dynamiq-bench allreduce --rank=0 --world_size=2 --serve_store --codec=dynamiq --bits=5 &\n"
      "         dynamiq-bench allreduce --rank=1 --world_size=2 --codec=dynamiq --bits=5\n"
      "Example: dynamiq-bench sweep --ranks=2 --transport=tcp --codec=none,dynamiq --topology=ring,two_shot\n"
      "Example: dynamiq-bench controller --target_vnmse=1e-3 --workers=8 --steps=100 --shift_step=30 --revert_step=60");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2)
    return Fail("missing subcommand (codec, step-budget, allreduce, sweep or controller); see --help");
  const std::string command = args[1];
  if (command == "codec") return RunCodec();
  if (command == "allreduce") return RunAllReduce();
  if (command == "controller") return RunController();
  if (command == "sweep") return RunSweep();
  if (command == "step-budget") return RunStepBudget();
  return Fail(absl::StrCat("unknown subcommand '", command, "'; see --help"));
}
