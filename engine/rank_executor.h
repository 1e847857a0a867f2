// RankExecutor: one rank's part of a compressed multi-hop all-reduce of one bucket. It knows,
// from the Schedule, what this rank sends at every step and what to do with what it receives:
//
//   send, no children for the chunk       -> Compress(local)                          (leaf)
//   receive, more children still to come -> DecompressAccumulate into an fp32 accumulator
//   receive, last child                   -> DecompressAccumulateRecompress(local or accumulator)
//                                            into the bytes to send next (or, at the owner, the
//                                            final bytes, which the owner decodes like everyone else)
//   all-gather receive                    -> Decompress into the output, forward the same bytes
//
// Transport-agnostic: the in-process simulator and the network engines move the bytes.
// Memory: one chunk of compressed bytes per pending send plus one fp32 accumulator per chunk with
// several children (O(log n) chunks for butterfly, none for ring); never O(n * d).
// Not thread-safe; one executor per rank per collective.
#ifndef DQ_ENGINE_RANK_EXECUTOR_H_
#define DQ_ENGINE_RANK_EXECUTOR_H_

#include <stdint.h>

#include <map>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/buffer_pool.h"
#include "engine/schedule.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

class RankExecutor {
 public:
  // `local` and `out` cover the whole bucket (plan.num_elements). The caller keeps codec,
  // schedule and plan alive for the executor's lifetime.
  // Message buffers come from `pool` and go back to it on destruction (null: a pool of its own);
  // the pool must outlive the executor.
  // `chunks`: the n chunks of the bucket (every rank must pass the same); empty: ChunkOf's
  // equal-element split (engine/block_plan.h BalancedChunks is the other one).
  RankExecutor(const kernels::Codec& codec, const Schedule& schedule, const kernels::BucketPlan& plan,
               const kernels::Source& local, const kernels::Dest& out, BufferPool* pool = nullptr,
               std::vector<kernels::ChunkRef> chunks = {});
  ~RankExecutor();
  RankExecutor(const RankExecutor&) = delete;
  RankExecutor& operator=(const RankExecutor&) = delete;

  int rank() const { return rank_; }

  // Peers of reduce-scatter / all-gather step `step`; -1 when this rank sits the step out.
  int ReduceScatterSendPeer(int step) const { return rs_send_[step].peer; }
  int ReduceScatterRecvPeer(int step) const { return rs_recv_[step].peer; }
  int AllGatherSendPeer(int step) const { return ag_send_[step].peer; }
  int AllGatherRecvPeer(int step) const { return ag_recv_[step].peer; }
  // Chunks received at a step (-1 when none).
  int ReduceScatterRecvChunk(int step) const { return rs_recv_[step].chunk; }
  int AllGatherRecvChunk(int step) const { return ag_recv_[step].chunk; }

  // Have the codec checksum the messages it encodes as it writes them (Codec::CompressChecksummed),
  // for the step headers: one pass over a message instead of two where the codec can.
  void ChecksumMessages() { checksum_messages_ = true; }
  // PayloadChecksum of the message the last ReduceScatterSend or AllGatherSend returned, when known
  // (ChecksumMessages, or a forwarded message received with its checksum).
  std::optional<uint64_t> SentChecksum() const { return sent_sum_; }

  // For codecs whose message bodies are plain fp32 (Codec::BodyIsFloat32, none) over a transport
  // that SupportsParts, after ChecksumMessages: keeps message bodies where the values are instead of
  // copying them through buffers. The first send of a chunk sends the input's values; the owned
  // chunk's last DAR writes its sum into the output; all-gather receives land in the output
  // (AllGatherRecvBody) and are forwarded from there. Each where the input or output is plain fp32
  // memory. A message is then what ReduceScatterSend / AllGatherSend return and then SentBody().
  void UseFloat32Bodies();
  // The body that follows the last ReduceScatterSend or AllGatherSend's bytes (empty: none).
  absl::Span<const uint8_t> SentBody() const { return sent_body_; }
  // Where the body of all-gather step `step`'s message goes (its chunk in the output), with
  // UseFloat32Bodies; empty otherwise. The message's other bytes go to AllGatherReceive.
  absl::Span<uint8_t> AllGatherRecvBody(int step) const;

  // The bytes to send at the step (valid until the next call on this executor).
  absl::StatusOr<absl::Span<const uint8_t>> ReduceScatterSend(int step);
  // Whether ReduceScatterSend(step) compresses local values (else it sends a partial sum that a
  // receive already re-encoded, or nothing).
  bool ReduceScatterSendCompresses(int step) const {
    return rs_send_[step].chunk >= 0 && pending_.count(rs_send_[step].chunk) == 0;
  }
  // `verify`: the message's checksum from its header, still to be verified (StepMessenger::Receive
  // deferred it): DATA_LOSS if it does not match, checked while decoding where the codec can.
  absl::Status ReduceScatterReceive(int step, absl::Span<const uint8_t> message,
                                    std::optional<uint64_t> verify = std::nullopt);
  // After the last reduce-scatter step: decodes the owned chunk into the output.
  absl::Status FinishReduceScatter();
  absl::StatusOr<absl::Span<const uint8_t>> AllGatherSend(int step);
  absl::Status AllGatherReceive(int step, absl::Span<const uint8_t> message);
  // The same, taking the received message's buffer (sized to the message) and its header's checksum
  // if any (verified here when `verify`, as it is decoded): it is forwarded as it is, with no copy.
  absl::Status AllGatherReceive(int step, Bytes message, std::optional<uint64_t> checksum = std::nullopt,
                                bool verify = false);

  // Bytes of the owned chunk's final compressed form (after FinishReduceScatter).
  size_t owned_bytes() const { return owned_.size(); }

  // Upper bound of any message this rank receives at a step (for sizing receive buffers).
  size_t MaxMessageBytes(int chunk) const;

 private:
  struct Move {
    int chunk = -1;
    int peer = -1;
  };
  kernels::Source AccumulatorSource(int chunk) const;
  // Chunk c as this rank compresses it for its parent, with its sibling group for correlated
  // rounding (see kernels::ChunkRef); the owner's final compression has no siblings.
  kernels::ChunkRef CompressRef(int chunk) const;
  // Sizes `buffer` to `size` bytes, swapping it for a pool buffer when it is too small.
  void Fit(Bytes& buffer, size_t size);
  // Chunk c's values in the output, as bytes (UseFloat32Bodies with a plain fp32 output).
  absl::Span<uint8_t> OutputBody(int chunk) const;

  const kernels::Codec& codec_;
  std::vector<kernels::ChunkRef> chunks_;  // chunk c's elements
  const Schedule& schedule_;
  const kernels::BucketPlan& plan_;
  kernels::Source local_;
  kernels::Dest out_;
  int rank_;
  int n_;
  std::vector<Move> rs_send_, rs_recv_, ag_send_, ag_recv_;
  std::vector<int> children_left_;                  // per chunk: receives still to come
  std::vector<kernels::ChunkRef> compress_ref_;     // per chunk, see CompressRef
  std::map<int, std::vector<float>> accumulators_;  // chunks with several children
  std::map<int, Bytes> pending_;                    // compressed partial sums waiting to be sent
  BufferPool own_pool_;                             // when the caller gives none
  BufferPool* pool_;
  Bytes scratch_;  // leaf compression output
  int owned_chunk_;
  Bytes owned_;
  Bytes forward_;  // all-gather bytes received last step
  // With ChecksumMessages: the PayloadChecksum of each message buffer above, where known.
  bool checksum_messages_ = false;
  std::map<int, std::optional<uint64_t>> pending_sums_;
  std::optional<uint64_t> scratch_sum_, owned_sum_, forward_sum_, sent_sum_;
  // UseFloat32Bodies: first sends' bodies from the input; bodies in the output (the owned chunk
  // once its sum is there, all-gather receives).
  bool bodies_from_local_ = false, bodies_in_out_ = false, owned_in_out_ = false;
  absl::Span<const uint8_t> forward_body_, sent_body_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_RANK_EXECUTOR_H_
