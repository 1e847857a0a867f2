// dynamiqd: the per-node dynamiq daemon. See docs/design.md and `dynamiqd --help`.
#include <malloc.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iostream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/flag_names.h"
#include "common/log.h"
#include "common/thread_pool.h"
#include "kernels/codec_info.h"
#include "server/build_info.h"
#include "server/daemon.h"

ABSL_FLAG(uint32_t, node_rank, 0, "This node's rank in the cluster (0..num_nodes-1).");
ABSL_FLAG(uint32_t, num_nodes, 1, "Number of nodes (one dynamiqd each).");
ABSL_FLAG(std::string, coordinator, "",
          "host:port of the coordinator (serves rendezvous and membership). Empty: node 0 is the coordinator "
          "and serves it on --listen; other nodes must name node 0's --listen address.");
ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "Operator and peer gRPC address (TCP). Its host is also the address peers reach this node's "
          "all-reduce transport on; use a routable address for multi-node clusters. Port 0 picks one.");
ABSL_FLAG(std::string, worker_socket, "",
          "Unix socket local workers connect to (created with mode 0600). Its folder must be writable by this user "
          "only (created 0700 if missing). Default: /run/dynamiq/dynamiqd.sock as root, else "
          "/tmp/dynamiq-<uid>/dynamiqd.sock (what workers use when DQ_SOCKET is unset).");
ABSL_FLAG(std::string, codec, "dynamiq",
          "Default codec of new jobs: none, bf16, dynamiq, mxfp8, mxfp6, mxfp4, thc, uniform, int8, global_qsgd, "
          "arc_topk, flash. int8 is INTELLECT-1's codec for DiLoCo pseudo-gradients (per-chunk clip at +-6 sigma); on "
          "raw gradients it clips the heavy tail. flash is Flash Communication's group-wise asymmetric INT-b "
          "(round to nearest) for the two_shot topology (docs/compressors.md).");
ABSL_FLAG(double, bits, 0,
          absl::StrCat(
              "Default bits of new jobs: dynamiq average bits/coord incl. metadata (3..8); uniform, "
              "global_qsgd and flash bits per code (2..8); thc 4; arc_topk the density (fraction of 256-element rows "
              "kept, 0.001..1). 0: the codec's own default (",
              dynamiq::kernels::DefaultBitsSummary(),
              "), as dynamiqctl set-compression gives it. The other codecs have no bit setting and take "
              "none."));
ABSL_FLAG(double, target_vnmse, 0,
          "Default error budget of new jobs (codec dynamiq): the controller on node 0 picks the lowest average bit "
          "budget in [--min_bits, --max_bits] that keeps the measured vNMSE at or under this (docs/error_budget.md); "
          "0: fixed --bits. --bits is where it starts.");
ABSL_FLAG(double, min_bits, 3, "Error budget: the lowest average bits/coordinate the controller may choose (3..8).");
ABSL_FLAG(double, max_bits, 8, "Error budget: the highest average bits/coordinate the controller may choose (3..8).");
ABSL_FLAG(double, budget_sample_rate, 0,
          "Error budget: fraction of a job's compressed collectives whose error is measured for the controller; "
          "0: --error_sample_rate.");
ABSL_FLAG(std::string, topology, "ring",
          "Default topology of new jobs: ring, butterfly (power-of-two nodes) or auto (per collective: butterfly "
          "for re-quantizing codecs on 8 or more power-of-two nodes, else ring; docs/design.md).");
ABSL_FLAG(uint64_t, min_compress_elements, 4096, "Tensors with fewer elements go uncompressed (fp32).");
ABSL_FLAG(double, timeout, 300,
          "Seconds before a collective that has not completed fails on every participant. Also the local "
          "watchdog: a local worker that has not submitted the collective by then (stopped, hung) is named with "
          "its local rank and pid in the DEADLINE_EXCEEDED every participant gets (dynamiq_faults_total, "
          "kind=\"timeout\"). Also bounds the start-up wait for the coordinator and the other nodes.");
ABSL_FLAG(double, heartbeat_timeout, 10,
          "Seconds after which a node the coordinator has not heard from is silent (every node heartbeats every "
          "quarter of it): a job's collectives go on without it once at least --min_nodes remain, else they fail "
          "saying which node is silent (docs/operations.md, \"Nodes that leave\"). 0: no heartbeats (a node "
          "that dies fails collectives until --timeout). Node 0's value applies.");
ABSL_FLAG(uint32_t, min_nodes, 0,
          "The fewest nodes a job's collectives may run on when nodes go silent (0: every node, so a silent node "
          "fails the collectives instead of leaving the group). The mean is over the nodes that took part. Node "
          "0's value applies; every node must set the same.");
ABSL_FLAG(uint64_t, max_buffers, 16384,
          "Buffers all local workers together may hold at once (each kind). Every shared-memory buffer is one "
          "mapping of dynamiqd's, and vm.max_map_count (65530 by default) bounds them; past this limit "
          "AllocateBuffer fails with RESOURCE_EXHAUSTED.");
ABSL_FLAG(uint64_t, max_jobs, 256,
          "Jobs this daemon runs at once (each has a reducer thread and transports); a worker that would start "
          "another gets RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, device, "cpu",
          "Where jobs reduce: cpu (host shared-memory buffers; between nodes over --transport: tcp by default, or "
          "gloo) or cuda (a GPU node: workers may also get buffers in the GPU's memory through CUDA IPC handles; "
          "local reduce on the GPU, NCCL between nodes by default; codecs none, bf16 and dynamiq; no error budget "
          "and no --cluster_secret_file). cuda needs a dynamiqd "
          "built with CUDA and NCCL and a visible CUDA device, else dynamiqd refuses to start. Every node of a "
          "cluster must run the same --device.");
ABSL_FLAG(std::string, transport, "",
          "How jobs move data between nodes. CPU nodes: tcp (the default; plain TCP sockets, without Gloo's "
          "per-message rendezvous: faster where the CPU, not the link, is the bound), udp (tcp, plus UDP datagrams "
          "for jobs with --lossy_phase_ms / set-compression --lossy_phase_ms: the loss-tolerant all-reduce for lossy, "
          "long links) or gloo (Gloo's TCP transport). "
          "--device=cuda: nccl (the default): device to device over NCCL (InfiniBand, RoCE or NCCL's own sockets); "
          "gloo: the hybrid path for GPU nodes on ordinary Ethernet: reduce and compress on the GPU, move only the "
          "compressed chunks through pinned host memory over Gloo TCP, decode and accumulate on the GPU "
          "(bit-identical to the CPU engine). Every node of a cluster must run the same --transport. Several nodes "
          "over nccl run one job at a time (NCCL needs one launch order on every GPU); gloo and tcp run up to "
          "--max_jobs.");
ABSL_FLAG(
    double, lossy_phase_ms, 0,
    "New jobs run the loss-tolerant all-reduce (needs --transport=udp; codec none, bf16 or int8): no retransmission, "
    "each of its two phases (reduce-scatter, all-gather) ends this many milliseconds after this node's sends, "
    "with what arrived; the mean is over the contributions that arrived, and means that did not arrive keep "
    "this node's values until a resync (sync_state). Weighted and exact all-reduces stay reliable. 0: reliable "
    "(a job changes it with dynamiqctl set-compression --lossy_phase_ms).");
ABSL_FLAG(double, udp_send_mbps, 0,
          "With --transport=udp: the most this node sends datagrams at, in Mbit/s (its share of the narrowest link: "
          "datagrams have no congestion control, and a burst above the bottleneck's rate is lost in its queue); 0: as "
          "fast as the socket takes them.");
ABSL_FLAG(int32_t, cuda_device, 0,
          "With --device=cuda: the CUDA device (ordinal as this process sees it, after CUDA_VISIBLE_DEVICES) that "
          "holds the workers' device buffers and runs the reduction.");
ABSL_FLAG(int32_t, metrics_port, 9400,
          "Port of the Prometheus metrics endpoint (GET /metrics), bound on the host of --listen. 0 picks a free "
          "port (logged at startup and shown by `dynamiqctl status`); -1 turns metrics off. See docs/metrics.md.");
ABSL_FLAG(bool, arc_topk_error_feedback, false,
          "Jobs with codec arc_topk keep EF21 error feedback per tensor on this node (what the sparsifier leaves "
          "behind is sent later; off by default: it trained worse in docs/compressors.md's measurements). Every node "
          "of a cluster must use the same setting.");
ABSL_FLAG(double, arc_topk_momentum, 1.0,
          "arc_topk error feedback: EF21M's momentum eta in (0, 1] (each step v = (1 - eta) v + eta x is what the "
          "feedback tracks); 1: plain EF21. Every node of a cluster must use the same value.");
ABSL_FLAG(uint64_t, error_feedback_mib, 1024,
          "Most memory one job's arc_topk error feedback may hold on this node (8 bytes per element of every "
          "tensor, plus ~256 per tensor); a tensor that does not fit evicts the least recently used tensors' "
          "state, and only a tensor larger than the whole limit fails its collectives with RESOURCE_EXHAUSTED. "
          "Every node of a cluster must use the same value.");
ABSL_FLAG(double, error_sample_rate, 0.01,
          "Fraction (0..1) of compressed cross-node collectives whose compression error is measured against an "
          "exact fp32 sum computed on the side (an extra uncompressed all-reduce; "
          "dynamiq_compression_error_vnmse). Node 0's value applies to the whole cluster.");
ABSL_FLAG(int32_t, codec_threads, std::min(dynamiq::common::AvailableCpus(), dynamiq::server::kMaxCodecThreads),
          "CPU nodes: threads (1..256) that split the codec work of one cross-node collective (statistics, "
          "compress, DAR, decompress of each chunk, in ranges of super-groups), shared by all jobs; the results are "
          "bit-identical for any count. 1: the job's reducer thread only. Default: the CPUs this dynamiqd may run "
          "on (its affinity mask).");

ABSL_FLAG(bool, step_budget, false,
          "One DynamiQ bit budget per training step: the job's b̄ is the average over a step's buckets (a step: "
          "until a bucket's tensor name comes round again), split so that buckets holding more of the gradient's "
          "energy get more bits, planned from the previous step's results (docs/codec_real_gradients.md). Every "
          "node must set the same. CPU nodes only (GPU nodes keep the job's b̄).");

// Security (docs/security.md). Each is off when unset, as suits a trusted network only.
ABSL_FLAG(std::string, operator_token_file, "",
          "File holding the operator bearer token(s), one per line (mode 0600 or stricter, else dynamiqd refuses to "
          "start). When set, every dynamiq.v1.Control call must carry 'authorization: Bearer <token>' (dynamiqctl "
          "--token_file), else UNAUTHENTICATED. Re-read when it changes: rotate by adding a line, then removing the "
          "old one. grpc.health.v1 and reflection stay open.");
ABSL_FLAG(std::string, cluster_secret_file, "",
          "File holding the cluster secret, the same on every node (mode 0600 or stricter; at least 16 bytes, e.g. "
          "`openssl rand -hex 32`). When set, the coordinator's rendezvous only serves nodes presenting it, and "
          "every all-reduce message between nodes carries an HMAC-SHA256 tag under a per-job key derived from it, "
          "verified before the payload is decoded.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) for TLS on --listen; with --tls_key. Its subject alternative names must cover the "
          "host clients dial (the --listen/--coordinator host).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert (unencrypted; mode 0600 or stricter).");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate(s) this node verifies the coordinator's TLS certificate with (needed on every node of "
          "a multi-node cluster that uses --tls_cert).");

namespace {

dynamiq::server::Daemon* g_daemon = nullptr;

// glibc serves a block of at least M_MMAP_THRESHOLD bytes with a mapping of its own, unmapped when
// freed, but by default raises the threshold to the largest such block freed (up to 32 MiB). From
// then on the multi-MiB buffers of collectives are carved from per-thread arenas (up to 8 per core),
// and an arena keeps what it once held; as jobs and their threads come and go, threads land on ever
// more arenas, and RSS crept up for as long as the daemon ran (scripts/soak: +10-16 MB in 8 minutes,
// issue 42). A fixed threshold (setting it stops the adjustment) gives such blocks back when freed,
// at the cost of their page faults on the next allocation, small next to a collective of that size;
// and a few arenas bound what the small blocks' free lists keep (the daemon's threads mostly wait).
// scripts/soak --minutes 8 on 2 cores, median RSS in the first minute after the warm-up and in the
// last: 53 -> 57 MB (node 0) and 56 -> 60 MB (node 1) by default; 40 -> 41 and 39 -> 39 MB with both
// (docs/testing.md, "Load test and soak").
void KeepTheAllocatorFromGrowing() {
#ifdef __GLIBC__
  constexpr int kMmapThresholdBytes = 256 << 10;
  constexpr int kArenas = 4;
  if (mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes) != 1 || mallopt(M_ARENA_MAX, kArenas) != 1) {
    dynamiq::common::Log("cannot tune malloc; memory may grow with job churn");
  }
#endif
}

int Fail(const std::string& message) {
  dynamiq::common::Log("%s", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  KeepTheAllocatorFromGrowing();  // before any thread allocates
  // --help lists the flags of this file (abseil matches on the program name otherwise).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) { return absl::EndsWith(path, "server/main.cc"); };
  // "Flags from server/main.cc", not the build machine's path.
  usage_config.normalize_filename = [](absl::string_view path) {
    const size_t at = path.rfind("server/main.cc");
    return std::string(at == absl::string_view::npos ? path : path.substr(at));
  };
  usage_config.version_string = [] {
    return absl::StrCat("dynamiqd ", dynamiq::server::BuildVersion(), " (commit ", dynamiq::server::BuildGitCommit(),
                        ")\n");
  };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "per-node daemon for compressed gradient all-reduce. Local workers connect on "
      "--worker_socket; operators on --listen (dynamiq.v1.Control, grpc.health.v1, reflection).\n"
      "Prometheus metrics are served on --metrics_port (default 9400) at /metrics (docs/metrics.md).\n"
      "Security (docs/security.md): --operator_token_file, --cluster_secret_file, --tls_cert/--tls_key/--tls_ca; "
      "without them dynamiqd trusts its network.\n"
      "GPU nodes: --device=cuda [--cuda_device=N] (docs/design.md, \"GPU nodes\").\n"
      "With no flags it runs a single-node daemon on loopback.\n"
      "Two nodes: dynamiqd --num_nodes=2 --node_rank=0 --listen=10.0.0.1:7070\n"
      "           dynamiqd --num_nodes=2 --node_rank=1 --listen=10.0.0.2:7070 --coordinator=10.0.0.1:7070");
  // --help is an answer, not an error: exit 0 (abseil's own --help exits 1), like dynamiqctl.
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-help" || arg == "-h") {
      absl::flags_internal::SetProgramInvocationName(argv[0]);
      absl::flags_internal::FlagsHelp(std::cout, "server/main.cc", absl::flags_internal::HelpFormat::kHumanReadable,
                                      absl::ProgramUsageMessage());
      return 0;
    }
  }
  // --metrics-port is --metrics_port: flag names may be spelled with dashes.
  std::vector<std::string> normalized = dynamiq::common::FlagNamesWithUnderscores(argc, argv);
  std::vector<char*> args;
  for (std::string& a : normalized) args.push_back(a.data());
  const std::vector<char*> positional = absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() > 1) {
    return Fail(absl::StrCat("unexpected argument '", positional[1],
                             "': dynamiqd takes only flags (--name=value; see dynamiqd --help)"));
  }
  auto device = dynamiq::server::ParseDeviceKind(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return Fail(absl::StrCat("--device: ", device.status().message()));
  if (absl::GetFlag(FLAGS_cuda_device) < 0) {
    return Fail(absl::StrCat("--cuda_device must be 0 or more, got ", absl::GetFlag(FLAGS_cuda_device)));
  }
  auto config = dynamiq::server::MakeJobConfig(absl::GetFlag(FLAGS_codec), absl::GetFlag(FLAGS_bits),
                                               absl::GetFlag(FLAGS_topology),
                                               absl::GetFlag(FLAGS_min_compress_elements), "measured");
  if (!config.ok()) return Fail(std::string(config.status().message()));
  if (absl::GetFlag(FLAGS_target_vnmse) != 0) {
    if (absl::GetFlag(FLAGS_num_nodes) <= 1) {
      return Fail(
          "--target_vnmse needs the compression error measured between nodes, and one node sums locally without "
          "compressing: drop it, or run it with --num_nodes > 1");
    }
    dynamiq::server::ErrorBudgetPolicy budget;
    budget.target_vnmse = absl::GetFlag(FLAGS_target_vnmse);
    budget.min_bits = absl::GetFlag(FLAGS_min_bits);
    budget.max_bits = absl::GetFlag(FLAGS_max_bits);
    budget.sample_rate = absl::GetFlag(FLAGS_budget_sample_rate);
    if (absl::Status s = dynamiq::server::SetErrorBudget(budget, *config); !s.ok()) {
      return Fail(std::string(s.message()));
    }
    if (budget.sample_rate == 0 && absl::GetFlag(FLAGS_error_sample_rate) == 0) {
      return Fail("--target_vnmse needs error samples: set --budget_sample_rate or --error_sample_rate above 0");
    }
  }
  if (absl::Status s = dynamiq::server::SetLossyPhase(absl::GetFlag(FLAGS_lossy_phase_ms), *config); !s.ok()) {
    return Fail(absl::StrCat("--lossy_phase_ms: ", s.message()));
  }
  dynamiq::server::DaemonOptions o;
  o.node_rank = absl::GetFlag(FLAGS_node_rank);
  o.num_nodes = absl::GetFlag(FLAGS_num_nodes);
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.listen = absl::GetFlag(FLAGS_listen);
  if (const std::string socket = absl::GetFlag(FLAGS_worker_socket); !socket.empty()) o.worker_socket = socket;
  o.default_config = *config;
  o.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  o.heartbeat_timeout = absl::Seconds(absl::GetFlag(FLAGS_heartbeat_timeout));
  o.min_nodes = absl::GetFlag(FLAGS_min_nodes);
  o.max_buffers = absl::GetFlag(FLAGS_max_buffers);
  o.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.error_sample_rate = absl::GetFlag(FLAGS_error_sample_rate);
  o.arc_topk_error_feedback = absl::GetFlag(FLAGS_arc_topk_error_feedback);
  o.arc_topk_momentum = absl::GetFlag(FLAGS_arc_topk_momentum);
  o.error_feedback_mib = absl::GetFlag(FLAGS_error_feedback_mib);
  o.step_budget = absl::GetFlag(FLAGS_step_budget);
  o.codec_threads = absl::GetFlag(FLAGS_codec_threads);
  o.device = *device;
  o.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  o.transport = absl::GetFlag(FLAGS_transport);
  o.udp_send_mbps = absl::GetFlag(FLAGS_udp_send_mbps);
  o.security.operator_token_file = absl::GetFlag(FLAGS_operator_token_file);
  o.security.cluster_secret_file = absl::GetFlag(FLAGS_cluster_secret_file);
  o.security.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.security.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  o.security.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);

  // SIGTERM/SIGINT: stop taking work, fail in-flight collectives, release shm, exit 0.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  dynamiq::server::Daemon daemon(o);
  g_daemon = &daemon;
  // Signals are watched from the start: a daemon still waiting for its cluster stops within about a
  // second (CancelStart), a running one shuts down. Phase kDone ends the watcher.
  enum class Phase { kStarting, kRunning, kDone };
  std::atomic<Phase> phase{Phase::kStarting};
  std::atomic<bool> stopping{false};
  std::thread watcher([&] {
    const timespec poll{0, 200 * 1000 * 1000};
    while (phase.load() != Phase::kDone) {
      const int sig = sigtimedwait(&signals, nullptr, &poll);
      if (sig <= 0) continue;
      stopping = true;
      if (phase.load() == Phase::kStarting) {
        dynamiq::common::Log("signal %d during start-up, stopping", sig);
        daemon.CancelStart();
        continue;  // Start returns; main ends the process (phase kDone)
      }
      dynamiq::common::Log("signal %d, shutting down", sig);
      daemon.Shutdown(absl::Seconds(10));
      return;
    }
  });
  absl::Status started = daemon.Start();
  if (!started.ok()) {
    phase = Phase::kDone;
    watcher.join();
    if (stopping.load()) {
      dynamiq::common::Log("stopped before the cluster formed (%s)", started.ToString().c_str());
      return 0;
    }
    return Fail(started.ToString());
  }
  phase = Phase::kRunning;
  if (stopping.load()) daemon.Shutdown(absl::Seconds(10));  // a signal that came as Start finished
  const std::string metrics = daemon.metrics_address();
  dynamiq::common::Log("node %u/%u ready; operators on %s, workers on %s, metrics on %s", o.node_rank, o.num_nodes,
                       daemon.listen_address().c_str(), o.worker_socket.c_str(),
                       metrics.empty() ? "(off)" : absl::StrCat("http://", metrics, "/metrics").c_str());
  if (o.device == dynamiq::server::DeviceKind::kCuda) {
    dynamiq::common::Log("device cuda:%d (device buffers over CUDA IPC)", o.cuda_device);
  }
  // What goes between nodes, and what new jobs run: the settings every node must share.
  dynamiq::common::Log("transport %s between nodes; new jobs: %s", dynamiq::server::TransportName(o).c_str(),
                       dynamiq::server::DescribeJobConfig(o.default_config).c_str());
  dynamiq::common::Log(
      "operator token %s, TLS %s, cluster secret %s", o.security.operator_token_file.empty() ? "off" : "required",
      o.security.tls_cert_file.empty() ? "off" : "on", o.security.cluster_secret_file.empty() ? "off" : "on");
  daemon.Wait();
  phase = Phase::kDone;
  watcher.join();
  dynamiq::common::Log("stopped");
  return 0;
}
