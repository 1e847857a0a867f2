// `dynamiq-bench allreduce`: one rank of a compressed all-reduce between real processes over Gloo
// TCP. Rank 0 can host the rendezvous store; every rank generates the same synthetic gradients
// (all workers' rows, so each can compute the exact sum) and reports timing and error.
#ifndef DQ_BENCH_ALLREDUCE_BENCH_H_
#define DQ_BENCH_ALLREDUCE_BENCH_H_

#include <stdint.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/codec.h"

namespace dynamiq::bench {

struct AllReduceBenchOptions {
  int rank = 0;
  int world_size = 1;
  std::string store = "127.0.0.1:29500";  // host:port of the TCP rendezvous store
  bool serve_store = false;               // this rank hosts the store at `store`
  std::string hostname = "127.0.0.1";     // address this rank's transport binds and advertises
  std::string transport = "gloo";         // gloo (engine/gloo_transport.h) or tcp (engine/tcp_transport.h)
  kernels::CodecConfig codec;
  std::string topology = "ring";
  size_t elements = 1 << 20;  // fp32 values per rank
  int iterations = 5;
  int warmup = 1;
  absl::Duration timeout = absl::Seconds(120);
  size_t block_elements = size_t{4} << 20;
  uint64_t seed = 1;
  // Non-empty: every message carries an HMAC tag under a key derived from this secret
  // (engine/step_auth.h), as dynamiqd's --cluster_secret_file does; all ranks need the same one.
  std::string cluster_secret;
  // The JSON line lists every timed iteration's start and end (scripts/bench-network
  // --link-profile lines them up with the link's byte counter).
  bool timeline = false;
  // Records where each timed all-reduce's time goes (engine/timeline.h): the JSON line gets the
  // mean milliseconds per kind of work (time_ms), and with a non-empty `trace_out` every timed
  // iteration's spans are written there as a Chrome trace.
  bool time_breakdown = false;
  std::string trace_out;
  // Codec work of each collective split across this many threads (kernels/parallel_codec.h, as
  // dynamiqd --codec_threads); results are the same bits for any value.
  int codec_threads = 1;
  // engine::AllReduceOptions::balanced_chunks.
  bool balanced_chunks = false;
  // Non-empty: one raw little-endian float32 file per rank (all ranks read all of them, for the
  // exact sum) instead of the synthetic data; `elements` is then their length.
  std::vector<std::string> inputs;
  // Above 0: the loss-tolerant all-reduce (engine/lossy_all_reduce.h) over UDP datagrams instead of
  // the schedule (codec none, bf16 or int8), each phase ending this long after the rank's sends; the
  // ranks line up over `transport` between iterations. `udp_send_mbps`: its pacing (0: none).
  double lossy_phase_ms = 0;
  double udp_send_mbps = 0;
};

struct AllReduceBenchResult {
  std::string method;      // e.g. "dynamiq-ring-5", "dynamiq-ring-5-balanced"
  size_t elements = 0;     // per rank
  double seconds = 0;      // median over iterations
  double seconds_p99 = 0;  // 99th percentile over iterations (nearest rank)
  // Loss-tolerant runs: the mean over iterations of the fraction of contributions to this rank's
  // chunk, and of the other owners' means, that arrived in time.
  double coverage = 1, gathered = 1;
  double algbw_gbps = 0, busbw_gbps = 0;  // GB/s on the uncompressed size (nccl-tests definitions)
  uint64_t wire_bytes_per_rank = 0;       // bytes this rank sent per all-reduce, headers included
  double vnmse = 0;
  uint64_t output_checksum = 0;                               // of the result bytes: equal on all ranks
  std::vector<std::pair<int64_t, int64_t>> timeline_unix_us;  // per timed iteration: start, end
  // With time_breakdown: mean milliseconds per all-reduce of each engine::Timeline::Kind.
  std::vector<double> time_ms;
};

absl::StatusOr<AllReduceBenchResult> RunAllReduceBench(const AllReduceBenchOptions& options);

std::string FormatAllReduceJson(const AllReduceBenchResult& result, const AllReduceBenchOptions& options);

}  // namespace dynamiq::bench

#endif  // DQ_BENCH_ALLREDUCE_BENCH_H_
