// The host half of the device all-reduce (engine/nccl_allreduce.h): the per-rank program every
// rank derives from the schedule and the plan, and the driver that runs it over a Transport
// through a backend that owns the buffers and does the arithmetic. No CUDA or NCCL header, so
// the whole protocol also runs on the CPU (tests drive the driver with a host backend built on
// the CPU codecs over in-memory transports and compare with engine::AllReduce bit for bit).
//
// Why the Gloo engine's protocol cannot drive NCCL (engine/nccl_transport.h): NCCL has no tags,
// matches the k-th send A->B with the k-th receive on B from A, and needs the exact size up
// front. This protocol therefore never announces sizes: every rank derives every message's size
// from the plan, which all ranks compute from bit-identical reduced statistics, and posts its
// sends and receives in one fixed order, one NCCL group per (step, block):
//
//   0. handshake (n > 1): a 64-byte StepHeader to the ring successor, one from the predecessor.
//      It carries job, epoch, sequence, codec and bits (MatchStepHeader) and a digest of the
//      bucket size, topology, block size and codec settings, so ranks that would derive
//      different message sizes fail here, with an error naming the peer, instead of posting
//      mismatched NCCL operations (undefined behaviour in NCCL).
//   1. statistics (codecs with statistics, i.e. DynamiQ): every block's local statistics are
//      reduced with the bf16 codec over the same schedule by a host RankExecutor of its own,
//      exactly as engine::AllReduce does, so the reduced statistics are bit-identical on every
//      rank and to the CPU engine's. The messages (bf16, ~0.06 bytes per element) are staged
//      through small device buffers.
//   2. plans and blocks: blocks cut and planned as engine::AllReduce does (engine/block_plan.h):
//      codec.MakePlan per block from its reduced statistics; codecs without statistics plan the
//      bucket once and every block takes its slice.
//   3. leaves: every chunk this rank sends without having children is encoded from local values.
//   4. reduce-scatter step s, for block k = 0, 1, ...: wait until block k's earlier device work
//      is done and its last received chunk validated; post the send of the step's chunk and the
//      receive of exactly its planned size; wait (one NCCL group); queue the receive's
//      validation (header + width map copied back and compared with the expected bytes,
//      super-groups checked on the device) and its action: decode-accumulate (a child other than
//      the last), fused DAR in place (the last child; into the owner's final bytes at the owner).
//   5. the owner decodes its own final bytes, exactly what every other rank will decode.
//   6. all-gather step t, block k: forward the received bytes unchanged, decode them.
// Messages are the codec's self-describing chunks (32-byte header with chunk id, round = block,
// summands, payload size); no step headers and no checksums travel (the handshake covers
// job/epoch/sequence, the chunk header the rest).
//
// Pipelining: block k's transfer at a step overlaps the device work on blocks < k queued on the
// compute stream; only a host wait for block k's own previous work precedes its transfer.
#ifndef DQ_ENGINE_NCCL_ALLREDUCE_PROGRAM_H_
#define DQ_ENGINE_NCCL_ALLREDUCE_PROGRAM_H_

#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/allreduce.h"
#include "engine/schedule.h"
#include "engine/step_header.h"
#include "engine/transport.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

// One pipelining block: bucket elements [begin, begin + plan.num_elements), with its plan (widths,
// means) and its own round (sequence * 2^20 + k), as engine::AllReduce.
struct NcclBlock {
  size_t begin = 0;
  kernels::BucketPlan plan;
};

// engine::AllReduce's block size for a bucket (engine::BlockElements).
size_t NcclBlockElements(size_t num_elements, size_t block_elements);

// Cuts `plan` (a whole-bucket plan of this rank) into blocks, each with its slice (for codecs
// that do not plan per block). INVALID_ARGUMENT past 2^20 blocks.
absl::StatusOr<std::vector<NcclBlock>> MakeNcclBlocks(const kernels::BucketPlan& plan, uint64_t sequence,
                                                      size_t block_elements);

// What a rank does with the chunk it receives at a step.
enum class NcclReceiveAction : uint8_t {
  kNone,        // nothing received
  kAccumulate,  // reduce-scatter, a child other than the last: acc[chunk] += decode(received)
  kDar,         // reduce-scatter, the last child: bytes[chunk] = DAR(received, acc or local), in place
  kDecode,      // all-gather: out[chunk] = decode(received); the bytes are forwarded unchanged
};

// One rank's part of one step; the same for every block.
struct NcclStep {
  int send_peer = -1;
  int send_chunk = -1;
  int recv_peer = -1;
  int recv_chunk = -1;
  NcclReceiveAction action = NcclReceiveAction::kNone;
  bool init_accumulator = false;  // kAccumulate: the accumulator starts as the local values
  bool from_accumulator = false;  // kDar: add to the accumulator instead of the local values
  uint16_t recv_summands = 0;     // num_summands the received chunk's header must carry
};

// Everything one rank does, derived from the schedule alone (RankExecutor's logic, made explicit
// so that a device backend can run it).
struct NcclRankProgram {
  int rank = 0;
  int world_size = 1;
  int owned_chunk = -1;
  // Per chunk: chunk_id and the correlated-rounding fields of this rank's compression of it
  // (siblings of the same parent, as RankExecutor; none for the owner's final compression).
  // begin/count are per block: see NcclChunkRef.
  std::vector<kernels::ChunkRef> compress_refs;
  std::vector<uint8_t> leaf;         // per chunk: 1 = encoded from local values before step 0
  std::vector<uint8_t> accumulator;  // per chunk: 1 = several children (an fp32 accumulator)
  std::vector<uint16_t> summands;    // per chunk: num_summands of the bytes this rank produces
  std::vector<NcclStep> reduce_scatter, all_gather;
};

// UNIMPLEMENTED naming the schedule if it has more than one send or receive per rank and step
// (ValidateSchedule with kNcclStepLimits: the two-shot); INTERNAL if it breaks another assumption
// of the protocol (a chunk sent before all its children arrived, ...).
absl::StatusOr<NcclRankProgram> MakeNcclRankProgram(const Schedule& schedule, int rank);

// Chunk `chunk` of a block of `block_count` elements as this rank compresses it.
kernels::ChunkRef NcclChunkRef(const NcclRankProgram& program, size_t block_count, int chunk);

// Exact wire bytes of every chunk of every block, bytes[block][chunk]. Every rank computes the
// same table (codec.MaxEncodedBytes is exact for none, bf16 and DynamiQ). UNIMPLEMENTED for
// other codecs.
absl::StatusOr<std::vector<std::vector<size_t>>> NcclChunkBytes(const kernels::Codec& codec,
                                                                const std::vector<NcclBlock>& blocks, int world_size);

// The chunk header (and, for DynamiQ, the width map) of `chunk` of `plan` carrying `summands`:
// the bytes every correct sender writes in front of the chunk's super-groups / values.
absl::StatusOr<std::vector<uint8_t>> NcclChunkPrefix(const kernels::Codec& codec, const kernels::BucketPlan& plan,
                                                     const kernels::ChunkRef& chunk, uint16_t summands);

// OK if a received chunk's prefix equals the expected one (NcclChunkPrefix), else INVALID_ARGUMENT
// naming every header field that differs, or the first super-group whose width differs.
absl::Status NcclCheckChunkPrefix(absl::Span<const uint8_t> received, absl::Span<const uint8_t> expected);

// One transfer in posting order, for checking that every sender's order matches its receivers'.
struct NcclWireOp {
  int group = 0;  // the NCCL group it is launched in: (phase step) * blocks + block, RS before AG
  bool send = false;
  int peer = -1;
  int block = 0;
  int chunk = -1;
  size_t bytes = 0;
};
std::vector<NcclWireOp> NcclWireOps(const NcclRankProgram& program, const std::vector<std::vector<size_t>>& bytes);

// The handshake header this rank sends (sender = rank) or expects from `sender`.
StepHeader NcclHandshakeHeader(const kernels::Codec& codec, const AllReduceOptions& options, size_t num_elements,
                               int sender);

// What the driver needs from the memory and arithmetic side. Device backends queue work
// asynchronously and report its errors (including validation of received chunks) at the next
// Ready of the block; host backends may do everything at once.
class NcclAllReduceBackend {
 public:
  virtual ~NcclAllReduceBackend() = default;

  // codec.StatsLength(num_elements) statistics of the local values, on the host.
  virtual absl::Status LocalStats(absl::Span<float> stats) = 0;
  // Small host messages (handshake, statistics): a transport buffer holding a copy of `host`
  // (valid until the next StageSend), a transport buffer of `bytes` to receive into (valid until
  // the next StageRecv), and the copy back once the receive completed.
  virtual absl::StatusOr<absl::Span<const uint8_t>> StageSend(absl::Span<const uint8_t> host) = 0;
  virtual absl::StatusOr<absl::Span<uint8_t>> StageRecv(size_t bytes) = 0;
  virtual absl::Status Unstage(absl::Span<const uint8_t> wire, absl::Span<uint8_t> host) = 0;

  // Allocates the buffers of the main phase. The arguments outlive every later call.
  virtual absl::Status Setup(const kernels::BucketPlan& plan, const std::vector<NcclBlock>& blocks,
                             const NcclRankProgram& program, const std::vector<std::vector<size_t>>& bytes) = 0;
  // The transport buffer of chunk `chunk` of block `block` (exactly bytes[block][chunk] bytes):
  // what this rank sends of the chunk, and where it receives it.
  virtual absl::Span<uint8_t> ChunkBuffer(int block, int chunk) = 0;
  // Leaf: the chunk's buffer = its compression of the local values.
  virtual absl::Status Encode(int block, int chunk) = 0;
  // After a step's receive completed: validates it and applies step.action. `all_gather` and
  // `step_index` only label errors.
  virtual absl::Status OnReceive(int block, const NcclStep& step, bool all_gather, int step_index) = 0;
  // After the reduce-scatter: the owner decodes its owned chunk's final bytes into the output
  // (encoding them first when it had no children).
  virtual absl::Status FinishReduceScatter(int block) = 0;
  // Waits for the block's queued work; reports a failed validation, naming the peer.
  virtual absl::Status Ready(int block) = 0;
};

// Runs the protocol above for `num_elements` elements. Codecs: none, bf16, dynamiq; schedules:
// ring and butterfly (UNIMPLEMENTED otherwise, two-shot included). On any failure the transport
// is aborted, as engine::AllReduce does (the group is broken for this collective, and an NCCL
// operation still in flight must not outlive the backend's buffers); the caller re-forms the
// group. Errors are prefixed "rank r: ".
absl::StatusOr<AllReduceResult> RunNcclAllReduce(const kernels::Codec& codec, Transport& transport,
                                                 const AllReduceOptions& options, size_t num_elements,
                                                 NcclAllReduceBackend& backend);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_NCCL_ALLREDUCE_PROGRAM_H_
