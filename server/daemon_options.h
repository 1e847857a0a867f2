// DaemonOptions: how a dynamiqd runs (its flags, server/main.cc), and the checks Daemon::Start makes
// of them before it binds anything.
#ifndef DQ_SERVER_DAEMON_OPTIONS_H_
#define DQ_SERVER_DAEMON_OPTIONS_H_

#include <stddef.h>
#include <stdint.h>

#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/env.h"
#include "common/thread_pool.h"
#include "server/grpc_store.h"
#include "server/job_config.h"
#include "server/security.h"

namespace dynamiq::server {

struct DaemonOptions {
  uint32_t node_rank = 0;
  uint32_t num_nodes = 1;
  // host:port of the coordinator's gRPC server; empty: node 0 serves it on `listen`.
  std::string coordinator;
  // Operator / peer gRPC address (TCP). Its host is also the address the cross-node transport
  // binds for peers.
  std::string listen = "127.0.0.1:7070";
  std::string worker_socket = common::DefaultWorkerSocket();
  JobConfig default_config;
  absl::Duration timeout = absl::Seconds(300);
  // Elastic membership (server/membership.h): every node heartbeats to the coordinator every quarter
  // of heartbeat_timeout, and a node not heard from for longer is silent (zero: no heartbeats, a
  // fixed group). A job's group view shrinks past silent nodes down to min_nodes (0: the cluster's
  // size, i.e. it never shrinks: the collectives fail, naming the silent nodes). Node 0's apply.
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  uint32_t min_nodes = 0;
  // Shared memory limits.
  size_t max_shm_bytes = size_t{64} << 30;
  // Buffers all workers together may hold (each kind: shared memory, device memory). Every shared
  // memory buffer is one mapping of the daemon's, and vm.max_map_count (65530 by default) bounds
  // them all: past it mmap fails for everything else too.
  size_t max_buffers = 16384;
  // Jobs the daemon runs at once (each has a reducer thread and its transports).
  size_t max_jobs = 256;
  // Prometheus /metrics port on the host of `listen`: 0 picks a free one, -1 serves none (the
  // default here, so in-process daemons never collide; dynamiqd's flag defaults to 9400).
  int metrics_port = -1;
  // Fraction (0..1) of compressed cross-node collectives whose error is measured (see
  // server/error_probe.h). Node 0's value applies to the whole cluster.
  double error_sample_rate = 0.01;
  // arc_topk jobs: EF21 error feedback per tensor (server/error_feedback.h), at most
  // error_feedback_mib MiB of it per job.
  bool arc_topk_error_feedback = false;
  double arc_topk_momentum = 1.0;  // EF21M's eta in (0, 1]; 1: plain EF21
  size_t error_feedback_mib = 1024;
  // One DynamiQ bit budget per training step (server/step_budget_planner.h): each bucket's
  // cross-node collective runs at its share of the job's b̄, planned from the previous step. Every
  // node must set the same (Start fails otherwise). CPU nodes only: GPU nodes keep the job's b̄.
  bool step_budget = false;
  // Operator token, cluster secret and TLS files (server/security.h, docs/security.md); unset: off.
  SecurityOptions security;
  // Where jobs reduce: kCuda needs a build with CUDA and NCCL and CUDA device `cuda_device`
  // (Start fails with FAILED_PRECONDITION otherwise), codecs none/bf16/dynamiq, no error budget
  // and no cluster secret (the NCCL path is not authenticated).
  DeviceKind device = DeviceKind::kCpu;
  int cuda_device = 0;
  // How nodes move data between them. CPU nodes: "tcp" (engine/tcp_transport.h: plain TCP sockets
  // without Gloo's per-message rendezvous, and without copies for none; the default) or "gloo"
  // (Gloo's TCP transport). GPU nodes: "nccl" (device to device, over NCCL's
  // network: IB, RoCE, or its own sockets; the default) or "gloo" (the hybrid path: reduce and
  // compress on the GPU, the compressed chunks through pinned host memory over Gloo TCP;
  // engine/host_staged_transport.h).
  // "udp" (CPU nodes): tcp's connections for the reliable schedules, and a UDP socket per job and
  // group view for the loss-tolerant all-reduce (a job's lossy_phase_ms: engine/lossy_all_reduce.h).
  std::string transport;
  // --transport=udp: what each node sends datagrams at, at most, in Mbit/s (its share of the
  // narrowest link: datagrams have no congestion control); 0: as fast as the socket takes them.
  double udp_send_mbps = 0;
  // Threads that split the codec work of one cross-node collective on a CPU node (statistics,
  // compress, DAR, decompress; results bit-identical for any count), the reducer thread's
  // included, shared by all jobs: 1..kMaxCodecThreads. 1 here (in-process daemons start no
  // threads); dynamiqd's flag defaults to the CPUs it may use (common::AvailableCpus()).
  int codec_threads = 1;
  // Device memory limit of all workers' device buffers together (kCuda).
  size_t max_device_bytes = std::numeric_limits<size_t>::max();
};

inline constexpr int kMaxCodecThreads = common::kMaxPoolThreads;

// True if this dynamiqd was built with the device path (CUDA and NCCL found).
bool DaemonHasCudaSupport();

// Whether jobs move data between nodes with NCCL (a GPU node's default).
bool UsesNccl(const DaemonOptions& options);
// Whether they do with engine/tcp_transport.h (a CPU node's default; --transport=udp too, for the
// reliable schedules).
bool UsesTcp(const DaemonOptions& options);
// Whether jobs also get a datagram transport per group view (--transport=udp).
bool UsesDatagrams(const DaemonOptions& options);
// Whether this node's jobs can run `config`: a loss-tolerant all-reduce needs --transport=udp
// (FAILED_PRECONDITION saying so otherwise).
absl::Status CheckConfigForTransport(const JobConfig& config, const DaemonOptions& options);
// How jobs move data between nodes, as --transport names it once the default is resolved: "tcp",
// "udp" or "gloo" on a CPU node, "nccl" or "gloo" on a GPU node.
std::string TransportName(const DaemonOptions& options);
// The settings every node of a cluster must share because they change what goes between the nodes
// (the coordinator compares them when a node joins, server/rendezvous_service.h): --device,
// --transport, --step_budget, the arc_topk error feedback's, and new jobs' codec, bits (resolved:
// 0 is the codec's default), topology, min_compress_elements and error budget. Values as the flags
// would be given.
NodeSettings ClusterSettings(const DaemonOptions& options);
// OK if a node already running `live_jobs` jobs may start another: RESOURCE_EXHAUSTED at
// --max_jobs; FAILED_PRECONDITION for a second job of a multi-node cluster over NCCL, where every
// node would have to launch the jobs' NCCL collectives on its GPU in one agreed order (NCCL's rule
// for communicators sharing a device; nodes run jobs as their workers arrive, so the orders
// differ and the GPUs can deadlock). `quoted_job`: the refused job's name as messages quote it.
absl::Status CheckAnotherJob(const DaemonOptions& options, size_t live_jobs, absl::string_view quoted_job);

// INVALID_ARGUMENT naming the flag for options that contradict each other or are out of range;
// FAILED_PRECONDITION for --device=cuda in a build without CUDA and NCCL. The device itself is
// checked when the daemon starts.
absl::Status ValidateDaemonOptions(const DaemonOptions& options);

}  // namespace dynamiq::server

#endif  // DQ_SERVER_DAEMON_OPTIONS_H_
