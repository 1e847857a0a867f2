// JobConfig: a job's compression settings as every node applies them (dynamiq.v1.CompressionConfig,
// validated): the codec, the topology, the size under which tensors go uncompressed and, optionally,
// an error budget under which the coordinator's controller picks DynamiQ's b̄ itself
// (server/error_budget_service.h, docs/error_budget.md).
//
// The one form of a compression setting between the wire and the kernels: dynamiqctl and the
// Python API send a partial dynamiq.v1.CompressionConfig, ApplyCompressionChange merges it into the
// job's newest JobConfig, the coordinator's store holds it as that proto (serialized), and
// JobConfig::codec is the kernels' CodecConfig.
#ifndef DQ_SERVER_JOB_CONFIG_H_
#define DQ_SERVER_JOB_CONFIG_H_

#include <stdint.h>

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "dynamiq/v1/common.pb.h"
#include "engine/schedule.h"
#include "kernels/codec.h"
#include "server/compression_controller.h"

namespace dynamiq::server {

struct JobConfig {
  kernels::CodecConfig codec;
  engine::Topology topology = engine::Topology::kRing;
  uint64_t min_compress_elements = 0;
  // Set: codec.bits is the controller's current choice within the policy (codec is DynamiQ).
  std::optional<ErrorBudgetPolicy> error_budget;
  // Above zero: collectives run the loss-tolerant all-reduce (engine/lossy_all_reduce.h) over the
  // nodes' datagram transport, each of its two phases ending this long after the node's sends; codec none or
  // bf16, no budget. Zero: the reliable schedules.
  absl::Duration lossy_phase = absl::ZeroDuration();
};

// Parses and validates codec / bits / topology / allocator; INVALID_ARGUMENT with a message.
absl::StatusOr<JobConfig> MakeJobConfig(absl::string_view codec, double bits, absl::string_view topology,
                                        uint64_t min_compress_elements, absl::string_view allocator);
// Puts `config` under an error budget: INVALID_ARGUMENT for an invalid policy or a codec other than
// DynamiQ; the starting b̄ is the configured one clamped to the policy's range.
absl::Status SetErrorBudget(const ErrorBudgetPolicy& policy, JobConfig& config);
// The longest phase of the loss-tolerant all-reduce a job may ask for.
inline constexpr double kMaxLossyPhaseMs = 60000;
// Sets `config`'s loss-tolerant phase (0: reliable): INVALID_ARGUMENT outside [0, kMaxLossyPhaseMs],
// or above 0 with a codec other than none, bf16 or int8, or with an error budget.
absl::Status SetLossyPhase(double milliseconds, JobConfig& config);
// The proto form of a job configuration: every field set.
void ToProto(const JobConfig& config, dynamiq::v1::CompressionConfig* out);
// Validates a complete configuration (INVALID_ARGUMENT with a message): bits 0 is the codec's
// default, an empty topology or allocator ring or measured; an error budget with min_bits/max_bits
// 0 means the full range 3..8, and a zero target_vnmse no budget.
absl::StatusOr<JobConfig> FromProto(const dynamiq::v1::CompressionConfig& config);
// Merges an operator's change into `newest` (the job's newest configuration, staged or applied;
// `job_id` names it in errors). Set fields replace, unset ones keep; a new codec without bits gets
// its default bits; a budget on a job of another codec switches it to DynamiQ unless the change
// names a codec; a change of codec or bits without a budget returns to fixed bits; budget fields
// without a target change the current budget (INVALID_ARGUMENT when there is none). The result is
// validated as FromProto does.
absl::StatusOr<JobConfig> ApplyCompressionChange(const JobConfig& newest, const dynamiq::v1::CompressionConfig& change,
                                                 absl::string_view job_id);
// "dynamiq bits=5 ring min_compress=4096" (+ " target_vnmse=0.001 bits=[3,8]" under a budget).
std::string DescribeJobConfig(const JobConfig& config);

// Where a daemon reduces (dynamiqd --device): host memory with TCP or Gloo between nodes, or a CUDA
// device with NCCL between nodes (engine::NcclAllReduce).
enum class DeviceKind { kCpu, kCuda };
// A compression change as published to every node of a job: each applies `config` from the
// collective that epoch `epoch` starts at (server/cluster.h).
struct PublishedChange {
  uint64_t epoch = 0;
  JobConfig config;
};

// "cpu" or "cuda"; INVALID_ARGUMENT naming the accepted values otherwise.
absl::StatusOr<DeviceKind> ParseDeviceKind(absl::string_view name);
absl::string_view DeviceKindName(DeviceKind device);
// Whether jobs of a daemon on `device` can run `config`: on kCuda only the codecs the device
// all-reduce implements (kernels::CodecInfo::on_cuda) and no error budget (the error probe, whose samples
// an error budget needs, runs on CPU nodes only). INVALID_ARGUMENT with a message otherwise.
absl::Status CheckConfigForDevice(const JobConfig& config, DeviceKind device);
// Whether `config`'s error budget (none: OK) gets the error samples it steers by, on a cluster of
// `num_nodes` whose error probe samples at `error_sample_rate`: errors are only measured between
// nodes. FAILED_PRECONDITION saying what to change otherwise.
absl::Status CheckErrorBudgetSampled(const JobConfig& config, uint32_t num_nodes, double error_sample_rate);

}  // namespace dynamiq::server

#endif  // DQ_SERVER_JOB_CONFIG_H_
