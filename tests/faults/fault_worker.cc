// dq-fault-worker: a worker process for the fault suite and the load test, built on the C++ client
// (<dynamiq/client.h>) exactly as a training process uses it.
//
// Interactive mode (default): connects, allocates one buffer of --elements floats, prints
//   ready <worker_id> <pid>
// and then runs one command per stdin line, answering each all-reduce with one stdout line:
//   ar [ELEMENTS [NAME [DTYPE]]]   fill, all-reduce, check the sum:
//                                   ok <sequence> <config_epoch> <codec> <seconds> <contributors> <nodes>
//                                   (nodes: those that took part, "0,1,2")
//                                   bad <max_rel_err> <vnmse>        (result off by more than --tolerance)
//                                   err <CODE> <seconds> <message>   (the client's status)
//   ranks R0,R1,...                 later sums are over these global ranks only (nodes left the
//                                   group): ok ranks <sum of (rank + 1)>
//   ranks auto                      later sums are over global ranks 0..c-1, c the result's
//                                   contributors (the lowest nodes took part): ok ranks auto
//   sync VALUE                      syncs a state of 4099 bytes made from VALUE with every worker of
//                                   the job (dynamiq::SyncState, rank --global_rank of --world):
//                                   ok synced <copied 0|1> <source> <agreeing> <hash> equal
//   quit                            unregister and exit 0
// Every worker fills element i with (global_rank + 1) * (1 + i % 7), so the exact sum over
// --world workers is world (world + 1) / 2 * (1 + i % 7) whatever the iteration: a worker that joins
// late (a replacement after a crash) checks the same sums as the others.
//
// Load mode (--loop_iterations > 0): no stdin. Runs that many all-reduces, cycling through
// --sizes (comma-separated element counts; each a tensor of its own name), the larger ones as
// --async_buckets concurrent asynchronous requests, and prints one summary line
//   done <collectives> <errors> <bad> <payload_bytes> <seconds>
// Exit status: 0 if every all-reduce succeeded and checked, 1 otherwise, 2 on setup errors.
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dynamiq/client.h"
#include "dynamiq/sync_state.h"

ABSL_FLAG(std::string, socket, "", "dynamiqd's worker socket.");
ABSL_FLAG(std::string, job, "job", "Job id.");
ABSL_FLAG(uint32_t, local_rank, 0, "Local rank.");
ABSL_FLAG(uint32_t, local_world_size, 1, "Local world size.");
ABSL_FLAG(int64_t, global_rank, 0, "Rank among all workers of the job (fixes this worker's data).");
ABSL_FLAG(int64_t, world, 1, "Workers of the job on all nodes (fixes the expected sum).");
ABSL_FLAG(int64_t, elements, 65536, "Buffer size in float32 elements (the largest all-reduce).");
ABSL_FLAG(double, tolerance, 0, "Largest acceptable relative error per element (0: exact).");
ABSL_FLAG(double, max_vnmse, 1e30, "Largest acceptable vNMSE of a result (lossy codecs: check this instead).");
ABSL_FLAG(double, timeout, 60, "Client deadline per call, seconds.");
ABSL_FLAG(int64_t, loop_iterations, 0,
          "Load mode: run this many iterations instead of reading commands (every worker of a job the same "
          "number, so they all stop after the same collective).");
ABSL_FLAG(std::string, sizes, "256,4096,1048576", "Load mode: element counts to cycle through.");
ABSL_FLAG(int32_t, async_buckets, 4, "Load mode: tensors of at least 65536 elements go as this many async requests.");

namespace {

// The state "sync" makes: odd, so its last 16-bit chunk is half a chunk.
constexpr size_t kStateBytes = 4099;

float Value(int64_t rank, size_t i) { return static_cast<float>((rank + 1) * static_cast<int64_t>(1 + i % 7)); }

void FillF32(float* data, size_t n, int64_t rank) {
  for (size_t i = 0; i < n; ++i) data[i] = Value(rank, i);
}

uint16_t ToBf16(float f) {  // values here are small integers: exact in bf16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Check {
  double max_rel = 0;
  double vnmse = 0;
};

// Compares data (fp32 or bf16) with the exact sum of workers whose (global rank + 1) sum to `a`.
Check VerifySum(const void* data, dynamiq::DType dtype, size_t n, double a) {
  Check c;
  double err2 = 0, norm2 = 0;
  for (size_t i = 0; i < n; ++i) {
    const double want = a * static_cast<double>(1 + i % 7);
    const double got = dtype == dynamiq::DType::kFloat32 ? static_cast<const float*>(data)[i]
                                                         : FromBf16(static_cast<const uint16_t*>(data)[i]);
    const double d = std::isfinite(got) ? got - want : 1e30;
    c.max_rel = std::max(c.max_rel, std::fabs(d) / want);
    err2 += d * d;
    norm2 += want * want;
  }
  c.vnmse = err2 / norm2;
  return c;
}

// Compares data with the exact sum over `world` workers.
Check Verify(const void* data, dynamiq::DType dtype, size_t n, int64_t world) {
  return VerifySum(data, dtype, n, static_cast<double>(world) * static_cast<double>(world + 1) / 2);
}

void Fill(void* data, dynamiq::DType dtype, size_t n, int64_t rank) {
  if (dtype == dynamiq::DType::kFloat32) {
    FillF32(static_cast<float*>(data), n, rank);
  } else {
    uint16_t* h = static_cast<uint16_t*>(data);
    for (size_t i = 0; i < n; ++i) h[i] = ToBf16(Value(rank, i));
  }
}

std::string OneLine(absl::string_view s) {
  std::string out(s);
  std::replace(out.begin(), out.end(), '\n', ' ');
  return out;
}

int Loop(dynamiq::Client& client, dynamiq::Buffer& buffer, int64_t rank, int64_t world, double tolerance) {
  std::vector<size_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',', absl::SkipEmpty())) {
    uint64_t v;
    if (!absl::SimpleAtoi(s, &v) || v == 0 || v * 4 > buffer.size()) {
      absl::FPrintF(stderr, "dq-fault-worker: bad --sizes entry '%s'\n", s);
      return 2;
    }
    sizes.push_back(v);
  }
  const int32_t buckets = std::max(1, absl::GetFlag(FLAGS_async_buckets));
  const absl::Time start = absl::Now();
  const size_t iterations = static_cast<size_t>(absl::GetFlag(FLAGS_loop_iterations));
  uint64_t collectives = 0, errors = 0, bad = 0, bytes = 0;
  for (size_t k = 0; k < iterations; ++k) {
    const size_t n = sizes[k % sizes.size()];
    float* data = static_cast<float*>(buffer.data());
    FillF32(data, n, rank);
    absl::Status status;
    const std::string name = absl::StrCat("t", k % sizes.size());
    if (n >= 65536 && buckets > 1) {
      const size_t per = (n + buckets - 1) / buckets;
      std::vector<dynamiq::Future> futures;
      for (size_t b = 0, begin = 0; begin < n; ++b, begin += per) {
        futures.push_back(client.AllReduceAsync(buffer, begin * 4, std::min(per, n - begin), dynamiq::DType::kFloat32,
                                                absl::StrCat(name, ".", b)));
      }
      for (auto& f : futures) status.Update(f.Wait());
      collectives += futures.size();
    } else {
      status = client.AllReduce(buffer, 0, n, dynamiq::DType::kFloat32, name);
      ++collectives;
    }
    if (!status.ok()) {
      ++errors;
      absl::FPrintF(stderr, "dq-fault-worker: %s\n", status.ToString());
      continue;
    }
    bytes += n * 4;
    const Check c = Verify(data, dynamiq::DType::kFloat32, n, world);
    if (c.max_rel > tolerance || !(c.vnmse <= absl::GetFlag(FLAGS_max_vnmse))) {
      ++bad;
      absl::FPrintF(stderr, "dq-fault-worker: %d elements: max relative error %g vnmse %g\n", n, c.max_rel, c.vnmse);
    }
  }
  absl::PrintF("done %d %d %d %d %.3f\n", collectives, errors, bad, bytes, absl::ToDoubleSeconds(absl::Now() - start));
  fflush(stdout);
  return errors == 0 && bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  dynamiq::ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.job_id = absl::GetFlag(FLAGS_job);
  options.local_rank = absl::GetFlag(FLAGS_local_rank);
  options.local_world_size = absl::GetFlag(FLAGS_local_world_size);
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  const int64_t rank = absl::GetFlag(FLAGS_global_rank), world = absl::GetFlag(FLAGS_world);
  const double tolerance = absl::GetFlag(FLAGS_tolerance);
  const size_t capacity = static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_elements)));
  absl::StatusOr<dynamiq::Client> client = dynamiq::Client::Connect(options);
  if (!client.ok()) {
    absl::PrintF("err %s 0 connect: %s\n", absl::StatusCodeToString(client.status().code()),
                 OneLine(client.status().message()));
    return 2;
  }
  absl::StatusOr<dynamiq::Buffer> buffer = client->Allocate(capacity * sizeof(float));
  if (!buffer.ok()) {
    absl::PrintF("err %s 0 allocate: %s\n", absl::StatusCodeToString(buffer.status().code()),
                 OneLine(buffer.status().message()));
    return 2;
  }
  if (absl::GetFlag(FLAGS_loop_iterations) > 0) return Loop(*client, *buffer, rank, world, tolerance);

  absl::PrintF("ready %s %d\n", client->worker_id(), getpid());
  fflush(stdout);
  bool all_ok = true;
  double expected_sum = 0;  // set by "ranks" (-1: "ranks auto"); 0: every worker of --world
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.empty()) continue;
    if (f[0] == "quit") break;
    if (f[0] == "sync" && f.size() == 2) {
      // A state of kStateBytes bytes made from VALUE, synced with every worker of the job.
      int64_t value = 0;
      (void)absl::SimpleAtoi(f[1], &value);
      absl::StatusOr<dynamiq::Buffer> state = client->Allocate(kStateBytes);
      if (!state.ok()) {
        absl::PrintF("err %s 0 %s\n", absl::StatusCodeToString(state.status().code()),
                     OneLine(state.status().message()));
        fflush(stdout);
        continue;
      }
      uint8_t* b = static_cast<uint8_t*>(state->data());
      for (size_t i = 0; i < kStateBytes; ++i) b[i] = static_cast<uint8_t>(value * 31 + static_cast<int64_t>(i) * 7);
      dynamiq::SyncStateOptions o;
      o.rank = static_cast<uint64_t>(rank);
      o.world = static_cast<uint64_t>(world);
      absl::StatusOr<dynamiq::SyncStateResult> r = dynamiq::SyncState(*client, *state, 0, kStateBytes, o);
      if (!r.ok()) {
        absl::PrintF("err %s 0 %s\n", absl::StatusCodeToString(r.status().code()), OneLine(r.status().message()));
      } else {
        const uint64_t now = dynamiq::StateHash(absl::MakeConstSpan(b, kStateBytes));
        absl::PrintF("ok synced %d %d %d %x %s\n", r->copied ? 1 : 0, r->source, r->agreeing, now,
                     now == r->hash ? "equal" : "differs");
      }
      fflush(stdout);
      continue;
    }
    if (f[0] == "ranks" && f.size() == 2 && f[1] == "auto") {
      // Each result sums the first `contributors` global ranks (the nodes that took part are the
      // lowest ones: a test that kills the highest node and lets it rejoin).
      expected_sum = -1;
      absl::PrintF("ok ranks auto\n");
      fflush(stdout);
      continue;
    }
    if (f[0] == "ranks" && f.size() == 2) {
      // The workers whose data the next results sum (the nodes left after others went silent).
      double a = 0;
      for (absl::string_view r : absl::StrSplit(f[1], ',', absl::SkipEmpty())) {
        int64_t v = 0;
        if (absl::SimpleAtoi(r, &v)) a += static_cast<double>(v + 1);
      }
      expected_sum = a;
      absl::PrintF("ok ranks %g\n", a);
      fflush(stdout);
      continue;
    }
    if (f[0] != "ar") {
      absl::PrintF("err INVALID_ARGUMENT 0 unknown command '%s'\n", line);
      fflush(stdout);
      continue;
    }
    uint64_t n = capacity;
    if (f.size() > 1 && (!absl::SimpleAtoi(f[1], &n) || n == 0 || n > capacity)) n = capacity;
    const std::string name = f.size() > 2 ? f[2] : "grad";
    const dynamiq::DType dtype =
        f.size() > 3 && f[3] == "bfloat16" ? dynamiq::DType::kBFloat16 : dynamiq::DType::kFloat32;
    Fill(buffer->data(), dtype, n, rank);
    dynamiq::AllReduceResult result;
    const absl::Time start = absl::Now();
    absl::Status status = client->AllReduce(*buffer, 0, n, dtype, name, false, &result);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (!status.ok()) {
      all_ok = false;
      absl::PrintF("err %s %.3f %s\n", absl::StatusCodeToString(status.code()), seconds, OneLine(status.message()));
    } else {
      const double taking_part = static_cast<double>(result.contributors);
      const Check c = expected_sum > 0   ? VerifySum(buffer->data(), dtype, n, expected_sum)
                      : expected_sum < 0 ? VerifySum(buffer->data(), dtype, n, taking_part * (taking_part + 1) / 2)
                                         : Verify(buffer->data(), dtype, n, world);
      if (c.max_rel > tolerance) {
        all_ok = false;
        absl::PrintF("bad %g %g\n", c.max_rel, c.vnmse);
      } else {
        absl::PrintF("ok %d %d %s %.3f %d %s\n", result.sequence, result.config_epoch, result.codec, seconds,
                     result.contributors, absl::StrJoin(result.nodes, ","));
      }
    }
    fflush(stdout);
  }
  return all_ok ? 0 : 1;
}
