// AllReduce: DynamiQ's whole pipeline for one bucket over a real Transport.
//
//   1. statistics: each rank computes the codec's bucket statistics; sums are reduced by a
//      two-round direct exchange in bf16 (engine/stats_exchange.h), maxima all-gathered; every
//      rank ends with bit-identical statistics and derives the same plans (bit allocation,
//      centring);
//   2. reduce-scatter with per-hop fused DAR, then an all-gather that forwards the owners' final
//      bytes unchanged, so every rank ends with bit-identical results;
//   3. pipelining: the bucket is cut into blocks (engine/block_plan.h: each a sub-bucket with its
//      own plan, or its slice of the bucket's) that flow through the steps independently: block
//      k's first message leaves before block k + 1 is planned, and a block's next message leaves
//      as soon as its previous one has arrived and been decoded and re-quantized, while later
//      blocks are still on the wire;
//   4. the side lane (AllReduceOptions::side_sums): a few exact fp64 sums, exchanged directly while
//      the rest travels (engine/side_lane.h).
//
// Every message is a 64-byte StepHeader (engine/step_header.h) and its payload, whose receives are
// posted ahead with the plan's bound on its size; the header is validated before the payload is
// looked at, and payloads carry a checksum, or with an authenticator an
// HMAC tag (engine/step_auth.h) that is verified before the payload is decoded: a message with a
// bad or missing tag fails the collective with UNAUTHENTICATED naming the peer rank. All ranks
// must agree on whether an authenticator is used (the error says which side lacks one). Errors name this rank, the peer
// and what differed; a peer that stops answering fails the collective at the deadline instead of
// hanging. After an error the transport is aborted (posted receives must not outlive their
// buffers) and the caller re-forms the group.
//
// `local` and `out` may be the same buffer (in place): all reads of `local` happen before the
// first write to `out`. Memory: O(chunk) per block in flight plus the executor's buffers.
// Not thread-safe per transport: one collective at a time.
#ifndef DQ_ENGINE_ALLREDUCE_H_
#define DQ_ENGINE_ALLREDUCE_H_

#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/buffer_pool.h"
#include "engine/schedule.h"
#include "engine/step_auth.h"
#include "engine/timeline.h"
#include "engine/transport.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

struct AllReduceOptions {
  // kAuto: SelectTopology picks per collective (engine/topology_selector.h).
  Topology topology = Topology::kRing;
  uint64_t job_id = 0;
  uint64_t config_epoch = 0;
  uint64_t sequence = 0;  // collective number within the job; also keys the codec's randomness
  absl::Duration timeout = absl::Seconds(60);
  // Pipelining block size in elements (rounded up to a multiple of 256); 0 = one block.
  size_t block_elements = size_t{4} << 20;
  // Authenticates every message with the job's key (null: checksums only, for trusted networks).
  // Must outlive the call.
  const StepAuthenticator* authenticator = nullptr;
  // Message buffers reused across collectives (engine/buffer_pool.h); null: fresh ones for this
  // call. Callers that run collectives in a loop pass one (one per thread).
  BufferPool* buffers = nullptr;
  // Return the plans' per-super-group widths (AllReduceResult::plan_widths): ARC-Top-K's selected
  // rows, which its error feedback needs (server/error_feedback.h).
  bool keep_plan_widths = false;
  // Size-balanced splitting (engine/block_plan.h BalancedChunks): every block's chunks are cut so
  // that their encoded sizes are equal rather than their element counts. All ranks must agree.
  // Off by default (docs/compressors.md has the measurements); the CPU engine only.
  bool balanced_chunks = false;
  // DynamiQ: this collective's b̄ instead of the codec's bits (0: the codec's), e.g. its bucket's
  // share of one budget per step. Every rank must pass the same: it travels in the step headers.
  double bits = 0;
  // Records where this rank's time goes (engine/timeline.h); null: nothing is recorded.
  Timeline* timeline = nullptr;
  // Exact fp64 sums carried beside the data (engine/side_lane.h), for contribution accounting: in,
  // this rank's values; out, their sums over all ranks, added in rank order, so bit-identical on
  // every rank. Every rank must pass as many (at most kMaxSideSums); empty: no side lane, nothing
  // more on the wire. The memory must outlive the call.
  absl::Span<double> side_sums;
};

struct AllReduceResult {
  uint64_t bytes_sent = 0;  // all phases, headers included
  uint64_t bytes_received = 0;
  uint64_t stats_bytes_sent = 0;  // statistics phase only
  int blocks = 1;
  // The schedule that ran (what topology=auto resolved to).
  Topology topology = Topology::kRing;
  // With keep_plan_widths: BucketPlan::widths of the whole bucket (the blocks' plans joined; one
  // byte per super-group; empty for codecs without widths).
  std::vector<uint8_t> plan_widths;
};

// Sums `local` (num_elements values) over all ranks of `transport` into `out`.
// Source::subtract_per_group and Dest::add_per_group must be unset (the plan supplies them).
absl::StatusOr<AllReduceResult> AllReduce(const kernels::Codec& codec, Transport& transport,
                                          const AllReduceOptions& options, const kernels::Source& local,
                                          const kernels::Dest& out, size_t num_elements);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_ALLREDUCE_H_
