// dynamiq-example-worker: a worker process that all-reduces deterministic data through its node's
// dynamiqd and checks every result against the sum it computes itself.
//
// Every worker fills its buffer from its global rank g and the iteration t alone:
//   value(g, i, t) = (g + 1) * w(i, t) + b(g) * u(i),  w in [0.5, 1.5), u in [-0.5, 0.5),
//   b(g) in {-0.5, 0, 0.5},
// so the expected sum over W workers is A * w(i, t) + B * u(i) with A = W (W + 1) / 2 and
// B = sum of b(g): no worker needs another's data, and the sum stays at least A / 4 away from zero,
// so relative errors are meaningful. By default g = node_rank * local_world_size + local_rank and
// W = num_nodes * local_world_size (node rank and count from the daemon; local rank and size from
// DQ_LOCAL_RANK / DQ_LOCAL_WORLD_SIZE); --global_rank and --world_size override them.
//
// Even iterations all-reduce the whole buffer synchronously; odd ones split it into --buckets
// regions submitted asynchronously at once (as DDP overlaps buckets), then wait for all. One line
// per iteration gives the time, the max relative error and the vNMSE. An exact result (one node,
// codec none, or tensors under min_compress_elements) must match to --tolerance; a compressed one
// must have a vNMSE within what its codec (as the daemon reports it ran) promises, or --max_vnmse.
// The exit status is 1 if any iteration failed its check, 2 on an error from the client or daemon.
//
// --pause_every=K with --resume_file=PATH splits the run into phases that one registration spans
// (an operator can change the job's compression between them): after every K iterations the worker
// prints "paused after iteration t" and waits for the file PATH<p> (p = 1, 2, ...) to exist, at
// most --pause_timeout seconds, then goes on.
//
// Usage (one line per worker; here local rank 0 of 2):
//   DQ_SOCKET=/tmp/dynamiq-$(id -u)/dynamiqd.sock DQ_LOCAL_RANK=0 DQ_LOCAL_WORLD_SIZE=2 dynamiq-example-worker
//   --elements=1048576
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dynamiq/client.h"

ABSL_FLAG(int64_t, elements, 1 << 20, "Number of float32 elements in the buffer (all-reduced every iteration).");
ABSL_FLAG(int32_t, iterations, 10, "Number of iterations; even ones are synchronous, odd ones asynchronous.");
ABSL_FLAG(int32_t, buckets, 4, "Asynchronous iterations split the buffer into this many concurrent all-reduces.");
ABSL_FLAG(double, tolerance, 1e-5,
          "Largest relative error |result - sum| / |sum| of any element of an exact (uncompressed) result: "
          "one node, codec none, or a tensor under min_compress_elements.");
ABSL_FLAG(double, max_vnmse, 0,
          "Largest vNMSE of a compressed result; 0: the codec's own bound (about ten times what it measures on "
          "8 ranks: dynamiq 5 bits 8e-3, bf16 1e-4, mxfp8 4e-2, int8 2e-2, ...; arc_topk, a sparsifier: "
          "1 - density/2). Only codec none must be exact.");
ABSL_FLAG(bool, average, false, "Ask the daemon to average instead of sum (the check divides by --world_size).");
ABSL_FLAG(int64_t, global_rank, -1,
          "This worker's rank among all workers of the job; -1: node_rank * local_world_size + local_rank.");
ABSL_FLAG(int64_t, world_size, -1, "Number of workers of the job on all nodes; -1: num_nodes * local_world_size.");
ABSL_FLAG(std::string, socket, "",
          "dynamiqd's worker socket; empty: DQ_SOCKET or the default (/tmp/dynamiq-<uid>/dynamiqd.sock; as root "
          "/run/dynamiq/dynamiqd.sock).");
ABSL_FLAG(std::string, job, "", "Job id; empty: DQ_JOB or \"default\".");
ABSL_FLAG(int32_t, pause_every, 0,
          "After every this many iterations (0: never), wait for --resume_file<p> (p = 1, 2, ...) to exist "
          "before going on, staying registered: phases between which an operator changes the compression.");
ABSL_FLAG(std::string, resume_file, "", "Path prefix of the files that end the pauses of --pause_every.");
ABSL_FLAG(double, pause_timeout, 300, "Seconds to wait for a resume file before giving up (exit 2).");

namespace {

// Deterministic pseudo-random fractions in [0, 1) from small integer hashes (exact in double).
double Frac(uint64_t x) { return static_cast<double>((x * 2654435761u) % 1024u) / 1024.0; }
double W(uint64_t i, uint64_t t) { return 0.5 + Frac(i + 7919u * t); }
double U(uint64_t i) { return Frac(i * 40503u + 17u) - 0.5; }
double B(int64_t g) { return 0.5 * static_cast<double>(g % 3 - 1); }

void Fill(float* data, size_t n, int64_t g, uint64_t t) {
  const double a = static_cast<double>(g + 1), b = B(g);
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<float>(a * W(i, t) + b * U(i));
}

struct Errors {
  double max_rel = 0;  // max over elements of |got - want| / |want|
  double vnmse = 0;    // sum (got - want)^2 / sum want^2
  bool finite = true;
};

Errors Check(const float* data, size_t n, int64_t world, uint64_t t, bool average) {
  double sum_a = 0, sum_b = 0;
  for (int64_t g = 0; g < world; ++g) {
    sum_a += static_cast<double>(g + 1);
    sum_b += B(g);
  }
  const double scale = average ? 1.0 / static_cast<double>(world) : 1.0;
  Errors e;
  double err2 = 0, norm2 = 0;
  for (size_t i = 0; i < n; ++i) {
    const double want = (sum_a * W(i, t) + sum_b * U(i)) * scale;
    const double got = data[i];
    if (!std::isfinite(got)) e.finite = false;
    const double d = got - want;
    e.max_rel = std::max(e.max_rel, std::fabs(d) / std::fabs(want));
    err2 += d * d;
    norm2 += want * want;
  }
  e.vnmse = err2 / norm2;
  return e;
}

// The vNMSE a compressed all-reduce of this data may show with `codec` at `bits`: about ten times
// what the codec measures on a ring of 8 (README's table), so that a real fault (a wrong sum, a
// corrupt message: vNMSE near 1) fails while honest quantization error, on any cluster size, passes.
// Only codec none is exact; every other codec is lossy and has its bound here.
double CodecVnmseBound(const std::string& codec, double bits) {
  if (codec == "none") return 0;
  if (codec == "bf16") return 1e-4;
  if (codec == "mxfp8") return 4e-2;
  if (codec == "mxfp6") return 0.1;
  if (codec == "mxfp4") return 0.5;
  if (codec == "dynamiq") return 0.2 * std::pow(10.0, -0.7 * (std::clamp(bits, 3.0, 8.0) - 3.0));
  if (codec == "uniform") return 0.5 * std::pow(4.0, 4.0 - std::clamp(bits, 2.0, 8.0));
  if (codec == "thc") return 4.0;
  // Ring of 8, synthetic data: 2.6e-2 at 8 bits, about 8x per 2 bits fewer (docs/compressors.md).
  if (codec == "global_qsgd") return 0.3 * std::pow(3.0, 8.0 - std::clamp(bits, 2.0, 8.0));
  // 8-bit stochastic codes against a per-chunk scale, re-quantized at every hop: 6.8e-4 on this
  // data over 2 nodes, growing with the hops.
  if (codec == "int8") return 2e-2;
  // A sparsifier: the kept rows (a fraction `bits`, the density, of the 256-element rows) arrive
  // exact, the others not at all, so the error is the dropped rows' share of the energy, about
  // 1 - density on this data, whose rows carry similar energy. Half the kept share is the margin
  // for a sketch that ranks rows imperfectly; with the error feedback the dropped rows carry
  // the previous estimate, closer still.
  if (codec == "arc_topk") return 1.0 - 0.5 * std::clamp(bits, 0.0, 1.0);
  return 1.0;  // a codec this worker does not know: lossy, and no worse than sending nothing
}

int Fail(absl::string_view what, const absl::Status& status) {
  absl::FPrintF(stderr, "dynamiq-example-worker: %s: %s\n", what, status.ToString());
  return 2;
}

// Waits (polling, bounded by `timeout`) until `path` exists.
absl::Status WaitForFile(const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (access(path.c_str(), F_OK) != 0) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no resume file ", path, " after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "All-reduces deterministic float32 data through dynamiqd and checks the results.\n"
      "Connection settings come from DQ_SOCKET, DQ_JOB, DQ_LOCAL_RANK, DQ_LOCAL_WORLD_SIZE and DQ_TIMEOUT_SECONDS.\n"
      "Usage: dynamiq-example-worker [--elements=N] [--iterations=N] [--buckets=N] [--tolerance=X]");
  // --help lists the flags of files named like the program ("main.cc" etc.) by default; ours are here.
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) { return absl::EndsWith(path, "example_worker.cc"); };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::ParseCommandLine(argc, argv);
  const int64_t elements = absl::GetFlag(FLAGS_elements);
  const int32_t iterations = absl::GetFlag(FLAGS_iterations);
  const int32_t buckets = absl::GetFlag(FLAGS_buckets);
  const double tolerance = absl::GetFlag(FLAGS_tolerance);
  const double max_vnmse = absl::GetFlag(FLAGS_max_vnmse);
  const bool average = absl::GetFlag(FLAGS_average);
  const int32_t pause_every = absl::GetFlag(FLAGS_pause_every);
  const std::string resume_file = absl::GetFlag(FLAGS_resume_file);
  const double pause_timeout = absl::GetFlag(FLAGS_pause_timeout);
  if (elements <= 0 || iterations < 0 || buckets <= 0 || !(tolerance >= 0) || !(max_vnmse >= 0)) {
    absl::FPrintF(stderr,
                  "dynamiq-example-worker: need --elements > 0, --iterations >= 0, --buckets > 0, --tolerance >= 0, "
                  "--max_vnmse >= 0\n");
    return 2;
  }
  if (pause_every < 0 || (pause_every > 0 && resume_file.empty()) || !(pause_timeout > 0)) {
    absl::FPrintF(stderr, "dynamiq-example-worker: --pause_every >= 0 needs --resume_file, and --pause_timeout > 0\n");
    return 2;
  }

  dynamiq::ClientOptions options;
  if (!absl::GetFlag(FLAGS_socket).empty()) options.socket_path = absl::GetFlag(FLAGS_socket);
  if (!absl::GetFlag(FLAGS_job).empty()) options.job_id = absl::GetFlag(FLAGS_job);
  absl::StatusOr<dynamiq::Client> client = dynamiq::Client::Connect(options);
  if (!client.ok()) return Fail("connect", client.status());

  const int64_t world = absl::GetFlag(FLAGS_world_size) >= 0 ? absl::GetFlag(FLAGS_world_size)
                                                             : int64_t{client->num_nodes()} * options.local_world_size;
  const int64_t rank = absl::GetFlag(FLAGS_global_rank) >= 0
                           ? absl::GetFlag(FLAGS_global_rank)
                           : int64_t{client->node_rank()} * options.local_world_size + options.local_rank;
  if (world <= 0 || rank >= world) {
    absl::FPrintF(stderr, "dynamiq-example-worker: global rank %d is not in a world of %d workers\n", rank, world);
    return 2;
  }
  const dynamiq::CompressionConfig& config = client->config();
  absl::PrintF("worker %s: global rank %d of %d (node %d of %d, local rank %d of %d), job %s, codec %s %g bits %s\n",
               client->worker_id(), rank, world, client->node_rank(), client->num_nodes(), options.local_rank,
               options.local_world_size, options.job_id, config.codec, config.bits, config.topology);

  const size_t n = static_cast<size_t>(elements);
  absl::StatusOr<dynamiq::Buffer> buffer = client->Allocate(n * sizeof(float));
  if (!buffer.ok()) return Fail("allocate", buffer.status());
  float* data = static_cast<float*>(buffer->data());

  const bool lossy_possible = client->num_nodes() > 1;  // one node sums exactly, whatever the codec
  bool mismatch = false;
  for (int32_t t = 0; t < iterations; ++t) {
    if (pause_every > 0 && t > 0 && t % pause_every == 0) {
      absl::PrintF("paused after iteration %d\n", t - 1);
      fflush(stdout);
      const absl::Status resumed =
          WaitForFile(absl::StrCat(resume_file, t / pause_every), absl::Seconds(pause_timeout));
      if (!resumed.ok()) return Fail("pause", resumed);
    }
    Fill(data, n, rank, static_cast<uint64_t>(t));
    const bool async = t % 2 == 1;
    size_t requests = 1;
    // What the daemon ran, and the vNMSE that allows (0: the result must be exact).
    std::string ran_with = "-";
    double allowed_vnmse = 0;
    auto ran = [&](const dynamiq::AllReduceResult& r, size_t count) {
      ran_with = absl::StrCat(r.codec, "/", r.bits);
      if (lossy_possible && count >= client->config().min_compress_elements) {
        allowed_vnmse = std::max(allowed_vnmse, max_vnmse > 0 ? max_vnmse : CodecVnmseBound(r.codec, r.bits));
      }
    };
    const absl::Time start = absl::Now();
    if (!async) {
      dynamiq::AllReduceResult result;
      absl::Status s =
          client->AllReduce(*buffer, 0, n, dynamiq::DType::kFloat32, absl::StrCat("iter", t), average, &result);
      if (!s.ok()) return Fail(absl::StrCat("all-reduce of iteration ", t), s);
      ran(result, n);
    } else {
      const size_t per_bucket = (n + buckets - 1) / buckets;
      std::vector<dynamiq::Future> futures;
      futures.reserve(static_cast<size_t>(buckets));
      for (size_t begin = 0, b = 0; begin < n; begin += per_bucket, ++b) {
        const size_t count = std::min(per_bucket, n - begin);
        futures.push_back(client->AllReduceAsync(*buffer, begin * sizeof(float), count, dynamiq::DType::kFloat32,
                                                 absl::StrCat("iter", t, ".bucket", b), average));
      }
      requests = futures.size();
      absl::Status first_error;
      for (dynamiq::Future& f : futures) first_error.Update(f.Wait());
      if (!first_error.ok()) return Fail(absl::StrCat("asynchronous all-reduce of iteration ", t), first_error);
      for (dynamiq::Future& f : futures) ran(f.result(), per_bucket);
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    const Errors e = Check(data, n, world, static_cast<uint64_t>(t), average);
    const bool ok = e.finite && (allowed_vnmse > 0 ? e.vnmse <= allowed_vnmse : e.max_rel <= tolerance);
    mismatch |= !ok;
    const std::string check = allowed_vnmse > 0 ? absl::StrFormat("vnmse <= %.1e", allowed_vnmse)
                                                : absl::StrFormat("exact, max_rel <= %.0e", tolerance);
    absl::PrintF("iteration %d %s %d elements config %s %.6f s max_rel_err %.3e vnmse %.3e %s (%s)\n", t,
                 async ? absl::StrCat("async x", requests) : std::string("sync"), n, ran_with, seconds, e.max_rel,
                 e.vnmse, ok ? "OK" : "MISMATCH", check);
    fflush(stdout);
  }
  return mismatch ? 1 : 0;
}
