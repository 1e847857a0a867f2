// NcclAllReduce: DynamiQ's all-reduce with everything on the GPU: the rank's input and output,
// the compressed chunks and receive buffers, the codec kernels, and the NCCL point-to-point
// transfers (NcclTransport). Built as dynamiq_engine_nccl_allreduce when CUDA and NCCL are
// found; this header includes no CUDA or NCCL header.
//
// Protocol (engine/nccl_allreduce_program.h has the details): a 64-byte handshake with the ring
// neighbours proves that every rank will derive the same message sizes; the DynamiQ statistics are
// reduced exactly as engine::AllReduce reduces them (bf16 over the same schedule, on the host; the
// messages are tiny), so every rank derives the same plan and therefore the exact size of every
// chunk; then per reduce-scatter / all-gather step and pipelining block one NCCL group holds this
// rank's send and its receive of exactly the planned sizes, posted in the same order on every
// rank. Nothing announces a size on the wire. The result is bit-identical to engine::AllReduce's
// with the same codec settings, options and inputs (same plan, same codec math, same order).
//
// Where host memory is used: the statistics (2 floats per 256 elements; computed on the device
// by a small kernel bit-identical to DynamiqCodec::ComputeStats, then copied back), the plan,
// the level tables (uploaded once per call), the per-chunk width/offset arrays (uploaded once
// per call), and per received chunk its 32-byte header plus width map (one nibble per 256
// elements) and one int of device validation, copied back and checked before the chunk's bytes
// are sent on or the call returns.
//
// Device memory per call (from a DeviceAllReduceWorkspace, below: kept from one call to the next by
// a caller that passes one, so steady collectives allocate nothing; a few small pinned host buffers
// likewise): one buffer per chunk and block holding its compressed bytes (in all: the compressed size of the
// bucket, which for codec none is the bucket's own size), one fp32 chunk of scratch (DynamiQ
// mean centring), an fp32 accumulator per chunk with several children (butterfly) and block,
// the statistics, and the tables.
//
// Synchronous: returns once `device_out` holds the result (and `stream` is idle). Work on
// `stream` is ordered after whatever the caller queued there before (so `device_in` may still be
// in production on `stream`). device_in == device_out (in place) is allowed.
//
// Errors (prefixed "rank r: "): UNIMPLEMENTED for codecs other than none, bf16 and dynamiq;
// FAILED_PRECONDITION when a neighbour runs a different collective or configuration (naming it);
// INVALID_ARGUMENT when a received chunk's header, width map or super-groups are wrong (naming the
// sender, the chunk, the block and the step); transport errors as NcclTransport reports them;
// INTERNAL for CUDA errors. After any error the transport has been aborted, as engine::AllReduce
// aborts its transport: re-form the group.
// Not thread-safe per transport: one collective at a time.
#ifndef DQ_ENGINE_NCCL_ALLREDUCE_H_
#define DQ_ENGINE_NCCL_ALLREDUCE_H_

#include <stddef.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/allreduce.h"
#include "engine/nccl_transport.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

// The device and pinned host memory and the CUDA events a device all-reduce uses, kept between the
// calls of one caller (a job's data path): each grows to the largest call seen and is then reused,
// so a steady stream of collectives allocates nothing. An allocation inside a collective can wait
// for other work on the GPU (another job's NCCL kernel, waiting in turn for this node) and hang.
// One collective at a time; destroy it only when none runs (on its device).
class DeviceAllReduceWorkspace {
 public:
  DeviceAllReduceWorkspace();
  ~DeviceAllReduceWorkspace();
  DeviceAllReduceWorkspace(const DeviceAllReduceWorkspace&) = delete;
  DeviceAllReduceWorkspace& operator=(const DeviceAllReduceWorkspace&) = delete;

  // Starts a call: memory the previous call allocated on the side is folded into one block.
  absl::Status Begin();
  // Memory for the current call (256-byte aligned), valid until the next Begin.
  absl::StatusOr<void*> Device(size_t bytes);
  absl::StatusOr<void*> Pinned(size_t bytes);
  // `count` events (cudaEvent_t), created on first use.
  absl::StatusOr<std::vector<CUevent_st*>> Events(size_t count);

 private:
  class Arena;
  std::unique_ptr<Arena> device_;
  std::unique_ptr<Arena> host_;
  std::vector<CUevent_st*> events_;
};

// Sums `device_in` (num_elements fp32 values in device memory of transport.device()) over all
// ranks of `transport` into `device_out`, with the kernels on `stream` (a cudaStream_t of that
// device as void*; nullptr = the legacy default stream). `codec` is the CPU codec object of the
// configuration (kernels::CreateCodec): the device kernels read its settings and level tables.
absl::StatusOr<AllReduceResult> NcclAllReduce(const kernels::Codec& codec, NcclTransport& transport,
                                              const AllReduceOptions& options, const float* device_in,
                                              float* device_out, size_t num_elements, void* stream);

// The same all-reduce, the same kernels and the same result bit for bit, over any transport that
// moves device memory of CUDA device `device`: an NcclTransport, or a HostStagedTransport
// (engine/host_staged_transport.h: the hybrid path, compressed chunks through pinned host memory
// over Gloo TCP). The protocol only needs each pair's messages matched by tag, which both do.
// `workspace`: the caller's (reused across calls), or null for one of this call alone.
absl::StatusOr<AllReduceResult> DeviceAllReduce(const kernels::Codec& codec, Transport& transport, int device,
                                                const AllReduceOptions& options, const float* device_in,
                                                float* device_out, size_t num_elements, void* stream,
                                                DeviceAllReduceWorkspace* workspace = nullptr);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_NCCL_ALLREDUCE_H_
