// Plain types of the dynamiq client API: connection options, element types and the compression
// configuration the daemon reports. Include <dynamiq/client.h> rather than this header.
//
// Thread-safety: these are values; the usual rules for copying and reading them apply.
#ifndef DQ_CLIENT_INCLUDE_DYNAMIQ_OPTIONS_H_
#define DQ_CLIENT_INCLUDE_DYNAMIQ_OPTIONS_H_

#include <stddef.h>
#include <stdint.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace dynamiq {

/// How to reach this node's dynamiqd and who this worker is.
///
/// A default-constructed ClientOptions takes every field from the DQ_* environment variables
/// (parsed once per process), falling back to the defaults named below for unset ones; a program
/// may overwrite any field before calling Client::Connect(). If a DQ_* variable is set to an
/// unusable value, Client::Connect() fails with INVALID_ARGUMENT naming it.
struct ClientOptions {
  ClientOptions();

  /// Path of dynamiqd's worker Unix socket. Env DQ_SOCKET; default "/tmp/dynamiq-<uid>/dynamiqd.sock", as root
  /// "/run/dynamiq/dynamiqd.sock" (dynamiqd's default --worker_socket).
  std::string socket_path;
  /// Job id shared by all workers of one training job on every node. Env DQ_JOB; default
  /// "default".
  std::string job_id;
  /// This worker's rank among the job's workers on this node, below local_world_size.
  /// Env DQ_LOCAL_RANK; default 0.
  uint32_t local_rank = 0;
  /// Number of the job's workers on this node (at least 1). Env DQ_LOCAL_WORLD_SIZE; default 1.
  uint32_t local_world_size = 1;
  /// Deadline of every call to the daemon, including an all-reduce from submission to completion
  /// (must be positive). Env DQ_TIMEOUT_SECONDS; default 300 seconds.
  absl::Duration timeout = absl::Seconds(300);
  /// All-reduces through a submission ring in shared memory (a futex doorbell each way, no gRPC
  /// call each) when dynamiqd offers one; otherwise, or when the ring's slots are all in flight,
  /// one AllReduce call each. Results, errors and ordering are the same either way.
  /// Env DQ_SUBMISSION_RING (1/0); default true.
  bool submission_ring = true;
};

/// Element type of an all-reduced region. The daemon accumulates in fp32 whatever the type.
/// The values match dynamiq.v1.DType.
enum class DType : int {
  kFloat32 = 1,
  kBFloat16 = 2,
};

/// Bytes per element of `dtype`, or 0 if `dtype` is not a DType enumerator.
size_t DTypeSize(DType dtype);
/// "float32", "bfloat16", or "invalid".
absl::string_view DTypeName(DType dtype);

/// Where a buffer lives (Client::Allocate). The values match dynamiq.v1.MemoryKind.
enum class MemoryKind : int {
  /// POSIX shared memory mapped into this process (Buffer::data()).
  kHost = 0,
  /// Memory on the daemon's CUDA device, opened in this process through a CUDA IPC handle
  /// (Buffer::device_data()). Only from a daemon that runs with --device=cuda.
  kCudaDevice = 1,
};

/// Where the daemon reduces (dynamiqd --device), as it reported at registration.
enum class DeviceKind : int {
  kCpu = 0,
  kCuda = 1,
};

/// A job's gradient compression as the daemon reported it at registration (dynamiq.v1.CompressionConfig).
struct CompressionConfig {
  /// none, bf16, dynamiq, mxfp8, mxfp6, mxfp4, thc, uniform, int8, global_qsgd, arc_topk or flash.
  std::string codec;
  /// dynamiq: average bits per coordinate including metadata; uniform, global_qsgd, flash: bits per code;
  /// arc_topk: the density.
  double bits = 0;
  /// ring or butterfly.
  std::string topology;
  /// Tensors with fewer elements travel uncompressed.
  uint64_t min_compress_elements = 0;
  /// dynamiq bit allocator: measured or paper.
  std::string allocator;
};

/// How an all-reduce combines the workers' values.
struct AllReduceOptions {
  /// Divide the sum by the number of workers, or with weights by the sum of the weights.
  bool average = false;
  /// Contribution accounting: this worker's weight (its sample count; finite, >= 0, 0 when it
  /// contributes nothing). The result is sum(w_i g_i) over every worker of every node, with
  /// `average` divided by sum(w_i) (0 when every weight is 0). Every worker of a collective gives a
  /// weight or every one none (the daemon fails the collective otherwise). Unset: weight 1.
  std::optional<double> weight;
  /// Uncompressed whatever the job's compression (codec none: exact fp32 sums), for values that
  /// must arrive bit for bit (SyncState). Every worker of a collective passes it alike.
  bool exact = false;
};

/// What the daemon reported for a completed all-reduce (dynamiq.v1.AllReduceResponse). Every
/// worker of a collective sees the same sequence, config epoch, codec and bits.
struct AllReduceResult {
  /// The collective's index among the job's collectives (0, 1, 2, ...).
  uint64_t sequence = 0;
  /// The compression config epoch the collective ran under, and that configuration's codec and bits
  /// (a tensor below its min_compress_elements still travelled uncompressed).
  uint64_t config_epoch = 0;
  std::string codec;
  double bits = 0;
  /// Bytes this node sent to other nodes for the collective (0 on a single node).
  uint64_t wire_bytes = 0;
  /// The compression error the daemon measured for this collective, when its error probe sampled
  /// it (dynamiqd --error_sample_rate): vNMSE of the cross-node result against an exact fp32
  /// all-reduce done on the side. Unset otherwise (and for uncompressed collectives).
  std::optional<double> measured_vnmse;
  /// What was summed: the workers of every node that contributed, and the sum of their weights
  /// (without weights, the number of workers).
  uint64_t contributors = 0;
  double weight_sum = 0;
  /// The nodes whose workers took part, by node rank: every node, or fewer once some left the
  /// job's group (dynamiqd --min_nodes; they went silent). For learning-rate scaling and logs.
  std::vector<uint32_t> nodes;
};

}  // namespace dynamiq

#endif  // DQ_CLIENT_INCLUDE_DYNAMIQ_OPTIONS_H_
