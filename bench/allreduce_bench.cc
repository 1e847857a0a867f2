#include "bench/allreduce_bench.h"

#include <algorithm>
#include <fstream>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/synthetic_gradients.h"
#include "bench/tcp_store.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "engine/allreduce.h"
#include "engine/host_transport.h"
#include "engine/lossy_all_reduce.h"
#include "engine/step_auth.h"
#include "engine/step_header.h"
#include "engine/store.h"
#include "engine/timeline.h"
#include "engine/udp_transport.h"
#include "kernels/codec_registry.h"
#include "kernels/parallel_codec.h"

namespace dynamiq::bench {

absl::StatusOr<AllReduceBenchResult> RunAllReduceBench(const AllReduceBenchOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", o.rank, " is not in a world of ", o.world_size));
  }
  if (o.iterations < 1) return absl::InvalidArgumentError("--iterations must be >= 1");
  if (o.warmup < 0) return absl::InvalidArgumentError("--warmup must be >= 0");
  DQ_ASSIGN_OR_RETURN(engine::Topology topology, engine::ParseTopology(o.topology));
  DQ_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Codec> plain_codec, kernels::CreateCodec(o.codec));
  DQ_RETURN_IF_ERROR(common::CheckPoolThreads("--codec_threads", o.codec_threads));
  std::unique_ptr<common::ThreadPool> pool;
  if (o.codec_threads > 1) pool = std::make_unique<common::ThreadPool>(o.codec_threads);
  const kernels::ParallelCodec parallel(*plain_codec, pool.get());
  const kernels::Codec* codec = &parallel;

  std::unique_ptr<TcpStoreServer> server;
  if (o.serve_store) {
    DQ_ASSIGN_OR_RETURN(server, TcpStoreServer::Start(o.store));
  }
  DQ_ASSIGN_OR_RETURN(std::unique_ptr<TcpStoreClient> store, TcpStoreClient::Connect(o.store, o.timeout));
  engine::PrefixStore scoped(absl::StrCat("bench/", o.world_size), *store);
  DQ_ASSIGN_OR_RETURN(std::unique_ptr<engine::Transport> transport,
                      engine::ConnectHostTransport(o.transport, scoped, o.rank, o.world_size, o.hostname, o.timeout));
  const bool lossy = o.lossy_phase_ms > 0;
  std::unique_ptr<engine::UdpTransport> datagrams;
  if (lossy) {
    if (!engine::LossyValuesOf(o.codec.id).has_value()) {
      return absl::InvalidArgumentError(
          "--lossy_phase_ms: the loss-tolerant all-reduce carries codec none, bf16 or int8");
    }
    engine::UdpTransportOptions udp;
    udp.hostname = o.hostname;
    udp.timeout = o.timeout;
    if (!o.cluster_secret.empty()) udp.key = engine::StepAuthenticator::KeyForJob(o.cluster_secret, "bench");
    DQ_ASSIGN_OR_RETURN(datagrams, engine::ConnectUdpTransport(scoped, o.rank, o.world_size, udp));
  }

  std::vector<std::vector<float>> inputs;
  if (o.inputs.empty()) {
    SyntheticOptions data;
    data.workers = o.world_size;
    data.elements = o.elements;
    data.seed = o.seed;
    inputs = SyntheticGradients(data);
  } else {
    if (static_cast<int>(o.inputs.size()) != o.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("--input names ", o.inputs.size(), " files for ", o.world_size, " ranks (one file per rank)"));
    }
    DQ_ASSIGN_OR_RETURN(inputs, ReadFloatFiles(o.inputs));
  }
  const size_t elements = inputs[0].size();
  const std::vector<double> exact = ExactSum(inputs);
  std::vector<float> out(elements);

  // A one-element uncompressed all-reduce lines the ranks up before every timed iteration.
  kernels::CodecConfig none_config;
  none_config.id = kernels::CodecId::kNone;
  DQ_ASSIGN_OR_RETURN(auto none, kernels::CreateCodec(none_config));
  std::unique_ptr<engine::StepAuthenticator> auth;
  if (!o.cluster_secret.empty()) auth = engine::StepAuthenticator::ForJob(o.cluster_secret, "bench");
  float token = 1, token_out = 0;
  uint64_t sequence = 0;
  auto barrier = [&]() -> absl::Status {
    engine::AllReduceOptions b;
    b.sequence = sequence++;
    b.timeout = o.timeout;
    b.job_id = 1;
    b.authenticator = auth.get();
    return engine::AllReduce(*none, *transport, b, {&token, kernels::DType::kFloat32, 0, nullptr},
                             {&token_out, kernels::DType::kFloat32, 0, nullptr}, 1)
        .status();
  };

  AllReduceBenchResult result;
  std::vector<double> seconds;
  double coverage = 0, gathered = 0;        // sums over the timed loss-tolerant iterations
  std::vector<engine::Timeline> timelines;  // per timed iteration, with time_breakdown
  engine::Timeline timeline;
  engine::BufferPool buffers;  // as a daemon's job reuses its message buffers
  for (int it = 0; it < o.warmup + o.iterations; ++it) {
    DQ_RETURN_IF_ERROR(barrier());
    engine::AllReduceOptions ar;
    ar.topology = topology;
    ar.sequence = sequence++;
    ar.timeout = o.timeout;
    ar.block_elements = o.block_elements;
    ar.authenticator = auth.get();
    ar.buffers = &buffers;
    ar.balanced_chunks = o.balanced_chunks;
    timeline.Clear();
    if (o.time_breakdown) ar.timeline = &timeline;
    const absl::Time start = absl::Now();
    uint64_t bytes_sent = 0;
    if (lossy) {
      engine::LossyAllReduceOptions l;
      l.sequence = ar.sequence;
      l.phase_timeout = absl::Milliseconds(o.lossy_phase_ms);
      l.send_bytes_per_second = o.udp_send_mbps * 1e6 / 8;
      l.values = *engine::LossyValuesOf(o.codec.id);
      DQ_ASSIGN_OR_RETURN(engine::LossyAllReduceResult r,
                          engine::LossyAllReduceMean(*datagrams, l, inputs[o.rank], absl::MakeSpan(out)));
      for (float& x : out) x *= static_cast<float>(o.world_size);  // the mean, as the sum it estimates
      bytes_sent = r.bytes_sent;
      if (it >= o.warmup) {
        coverage += r.coverage();
        gathered += r.gathered();
      }
    } else {
      DQ_ASSIGN_OR_RETURN(
          engine::AllReduceResult r,
          engine::AllReduce(*codec, *transport, ar, {inputs[o.rank].data(), kernels::DType::kFloat32, 0, nullptr},
                            {out.data(), kernels::DType::kFloat32, 0, nullptr}, elements));
      bytes_sent = r.bytes_sent;
    }
    const double t = absl::ToDoubleSeconds(absl::Now() - start);
    if (it >= o.warmup) {
      seconds.push_back(t);
      result.timeline_unix_us.emplace_back(absl::ToUnixMicros(start),
                                           absl::ToUnixMicros(start) + static_cast<int64_t>(t * 1e6));
      result.wire_bytes_per_rank = bytes_sent;
      if (o.time_breakdown) timelines.push_back(timeline);
    }
  }
  if (o.time_breakdown) {
    result.time_ms.assign(engine::Timeline::kNumKinds, 0);
    for (const engine::Timeline& t : timelines) {
      const std::vector<int64_t> totals = t.Totals();
      for (int k = 0; k < engine::Timeline::kNumKinds; ++k) result.time_ms[k] += totals[k] / 1e6 / timelines.size();
    }
    if (!o.trace_out.empty()) {
      // Every timed iteration: the ranks' files then hold the same all-reduces, which line up on the
      // wall clock (each rank's median iteration alone would be a different all-reduce per rank).
      engine::Timeline all;
      for (const engine::Timeline& t : timelines) {
        for (const engine::Timeline::Span& s : t.spans()) all.Add(s.kind, s.block, s.begin_ns, s.end_ns);
      }
      std::ofstream trace(o.trace_out);
      trace << all.ToChromeTrace(o.rank);
      if (!trace) return absl::UnavailableError(absl::StrCat("cannot write the trace to ", o.trace_out));
    }
  }
  std::sort(seconds.begin(), seconds.end());
  result.seconds = seconds[seconds.size() / 2];
  result.seconds_p99 = seconds[std::min(seconds.size() - 1, (seconds.size() * 99 + 99) / 100 - 1)];
  if (lossy) {
    result.coverage = coverage / static_cast<double>(seconds.size());
    result.gathered = gathered / static_cast<double>(seconds.size());
  }
  result.elements = elements;
  const double bytes = 4.0 * static_cast<double>(elements);
  result.algbw_gbps = bytes / result.seconds / 1e9;
  result.busbw_gbps = result.algbw_gbps * (o.world_size > 1 ? 2.0 * (o.world_size - 1) / o.world_size : 1.0);
  result.vnmse = Vnmse(out.data(), exact);
  result.output_checksum = engine::PayloadChecksum(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(out.data()), out.size() * sizeof(float)));
  const bool has_bits = o.codec.id == kernels::CodecId::kDynamiq || o.codec.id == kernels::CodecId::kUniform ||
                        o.codec.id == kernels::CodecId::kFlash;
  result.method = lossy ? absl::StrCat(kernels::CodecName(o.codec.id), "-lossy", o.lossy_phase_ms)
                        : absl::StrCat(kernels::CodecName(o.codec.id), "-", o.topology,
                                       has_bits ? absl::StrCat("-", o.codec.bits) : std::string(),
                                       o.balanced_chunks ? "-balanced" : "");
  return result;
}

std::string FormatAllReduceJson(const AllReduceBenchResult& r, const AllReduceBenchOptions& o) {
  std::string timeline;
  if (o.timeline) {
    std::vector<std::string> spans;
    for (const auto& [begin, end] : r.timeline_unix_us) spans.push_back(absl::StrCat("[", begin, ",", end, "]"));
    timeline = absl::StrCat(",\"timeline_unix_us\":[", absl::StrJoin(spans, ","), "]");
  }
  if (!r.time_ms.empty()) {
    std::vector<std::string> kinds;
    for (int k = 0; k < engine::Timeline::kNumKinds; ++k) {
      kinds.push_back(
          absl::StrFormat("\"%s\":%.3f", engine::Timeline::Name(static_cast<engine::Timeline::Kind>(k)), r.time_ms[k]));
    }
    absl::StrAppend(&timeline, ",\"time_ms\":{", absl::StrJoin(kinds, ","), "}");
  }
  return absl::StrFormat(
      R"({"method":"%s","codec":"%s","bits":%g,"topology":"%s","world_size":%d,"rank":%d,"elements":%d,)"
      R"("bytes_per_rank":%d,"seconds":%.6f,"algbw_GBps":%.4f,"busbw_GBps":%.4f,"wire_bytes_per_rank":%d,)"
      R"("vnmse":%.6g,"output_checksum":"%016x","authenticated":%s,"codec_threads":%d,"transport":"%s",)"
      R"("seconds_p99":%.6f,"coverage":%.6f,"gathered":%.6f%s})",
      r.method, kernels::CodecName(o.codec.id), o.codec.bits, o.lossy_phase_ms > 0 ? "two_shot" : o.topology,
      o.world_size, o.rank, r.elements, 4 * r.elements, r.seconds, r.algbw_gbps, r.busbw_gbps, r.wire_bytes_per_rank,
      r.vnmse, r.output_checksum, o.cluster_secret.empty() ? "false" : "true", o.codec_threads,
      o.lossy_phase_ms > 0 ? "udp" : o.transport, r.seconds_p99, r.coverage, r.gathered, timeline);
}

}  // namespace dynamiq::bench
