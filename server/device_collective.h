// DeviceCollective: the device half of a job's collectives on a GPU node (dynamiqd --device=cuda).
// A Job with one (Job::Options::device) runs every collective through it: the local reduce of its
// workers' regions into an fp32 sum in device memory, the cross-node all-reduce of that sum
// (engine::NcclAllReduce over the job's NcclTransport), and the write-back of the result into every
// worker's region. server/cuda_device.h implements it with CUDA; this header is CUDA-free, so the
// Job (and its tests, with a host implementation) need no CUDA.
//
// Regions are device memory (the workers' device buffers, ipc/device_buffers.h) or host memory
// (shared-memory buffers of workers that asked for host memory); an implementation stages host
// regions through the device.
//
// Thread-safety: one collective at a time (the job's reducer thread).
#ifndef DQ_SERVER_DEVICE_COLLECTIVE_H_
#define DQ_SERVER_DEVICE_COLLECTIVE_H_

#include <stddef.h>
#include <stdint.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/allreduce.h"
#include "engine/transport.h"
#include "kernels/codec.h"
#include "kernels/dtype.h"

namespace dynamiq::server {

class DeviceCollective {
 public:
  // One worker's region of `n` elements.
  struct Region {
    uint8_t* data = nullptr;
    kernels::DType dtype = kernels::DType::kFloat32;
    bool device = false;  // device memory of the collective's device (else host memory)
  };
  struct Output {
    Region region;
    bool average = false;  // write sum * scale instead of the sum
  };

  virtual ~DeviceCollective() = default;

  // The sum of `inputs` (in their order, accumulated in fp32) becomes the collective's sum of `n`
  // elements. Errors: RESOURCE_EXHAUSTED (no device memory for the sum), INTERNAL (device errors).
  virtual absl::Status LocalReduce(absl::Span<const Region> inputs, size_t n) = 0;
  // All-reduces the sum across the ranks of `transport` in place with `codec`. Errors as the
  // engine's; INVALID_ARGUMENT for a transport the implementation cannot drive.
  virtual absl::StatusOr<engine::AllReduceResult> CrossNode(const kernels::Codec& codec, engine::Transport& transport,
                                                            const engine::AllReduceOptions& options, size_t n) = 0;
  // Writes the sum (times `scale` for outputs that average), converted to each output's dtype, into
  // every output; returns once all of them hold it (the device work is complete).
  virtual absl::Status WriteBack(absl::Span<const Output> outputs, size_t n, float scale) = 0;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_DEVICE_COLLECTIVE_H_
