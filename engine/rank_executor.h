// RankExecutor: one rank's part of a compressed multi-hop all-reduce of one bucket. It knows,
// from the Schedule, what this rank sends at every step and what to do with what it receives:
//
//   send, no children for the chunk       -> Compress(local)                          (leaf)
//   receive, more children still to come -> DecompressAccumulate into an fp32 accumulator
//   receive, last child                   -> DecompressAccumulateRecompress(local or accumulator)
//                                            into the bytes to send next (or, at the owner, the
//                                            final bytes, which the owner decodes like everyone else)
//   all-gather receive                    -> Decompress into the output, keep the bytes to forward
//
// A step may hold several transfers of this rank (the two-shot's n - 1 sends and receives): they
// are named by their index in the step's list (ReduceScatterSends(step) ...), in the schedule's
// order. A receive's children are added in that order, so every run adds them alike. A send may
// be made as soon as it is ready (SendReady: its chunk's children have all arrived, or it forwards
// bytes this rank holds), before the step's other receives.
//
// Transport-agnostic: the in-process simulator and the network engines move the bytes.
// Memory: one chunk of compressed bytes per send in flight (until Sent) or waiting to be sent,
// and per all-gather chunk still to be forwarded, plus one fp32 accumulator per chunk with
// several children (O(log n) chunks for butterfly, one for two-shot, none for ring); never O(n * d).
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

  // This rank's transfers at reduce-scatter / all-gather step `step`: those it sends, those it
  // receives, in the schedule's order (empty when it sits the step out). The calls below name a
  // transfer by the step and its index `i` in these lists.
  const std::vector<Transfer>& ReduceScatterSends(int step) const { return rs_send_[step]; }
  const std::vector<Transfer>& ReduceScatterReceives(int step) const { return rs_recv_[step]; }
  const std::vector<Transfer>& AllGatherSends(int step) const { return ag_send_[step]; }
  const std::vector<Transfer>& AllGatherReceives(int step) const { return ag_recv_[step]; }

  // Whether send `i` of the step has all it needs: a leaf always; a partial sum once its chunk's
  // last child arrived; in the all-gather, the owned chunk once its last child arrived, another
  // chunk once this rank received its final bytes. A validated schedule makes every send of a
  // step ready once the earlier steps' receives are in.
  bool ReduceScatterSendReady(int step, int i) const;
  bool AllGatherSendReady(int step, int i) const;

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
  // Where the body of all-gather receive `i` of step `step` goes (its chunk in the output), with
  // UseFloat32Bodies; empty otherwise. The message's other bytes go to AllGatherReceive.
  absl::Span<uint8_t> AllGatherRecvBody(int step, int i) const;

  // The bytes of send `i` of the step (it must be ready). They stay valid until
  // ReduceScatterSent / AllGatherSent(step, i) (the message has left) or the executor's end.
  absl::StatusOr<absl::Span<const uint8_t>> ReduceScatterSend(int step, int i);
  void ReduceScatterSent(int step, int i);
  // Whether ReduceScatterSend(step, i) compresses local values (else it sends a partial sum that a
  // receive already re-encoded).
  bool ReduceScatterSendCompresses(int step, int i) const { return pending_.count(rs_send_[step][i].chunk) == 0; }
  // `verify`: the message's checksum from its header, still to be verified (StepMessenger::Receive
  // deferred it): DATA_LOSS if it does not match, checked while decoding where the codec can.
  absl::Status ReduceScatterReceive(int step, int i, absl::Span<const uint8_t> message,
                                    std::optional<uint64_t> verify = std::nullopt);
  // After the owned chunk's last child arrived: decodes the owned chunk into the output (its
  // all-gather sends may leave before).
  absl::Status FinishReduceScatter();
  absl::StatusOr<absl::Span<const uint8_t>> AllGatherSend(int step, int i);
  void AllGatherSent(int step, int i);
  absl::Status AllGatherReceive(int step, int i, absl::Span<const uint8_t> message);
  // The same, taking the received message's buffer (sized to the message) and its header's checksum
  // if any (verified here when `verify`, as it is decoded): it is forwarded as it is, with no copy.
  absl::Status AllGatherReceive(int step, int i, Bytes message, std::optional<uint64_t> checksum = std::nullopt,
                                bool verify = false);

  // Bytes of the owned chunk's final compressed form (after FinishReduceScatter).
  size_t owned_bytes() const { return owned_.bytes.size(); }

  // Upper bound of any message this rank receives at a step (for sizing receive buffers).
  size_t MaxMessageBytes(int chunk) const;

 private:
  kernels::Source AccumulatorSource(int chunk) const;
  // Chunk c as this rank compresses it for its parent, with its sibling group for correlated
  // rounding (see kernels::ChunkRef); the owner's final compression has no siblings.
  kernels::ChunkRef CompressRef(int chunk) const;
  // Sizes `buffer` to `size` bytes, swapping it for a pool buffer when it is too small.
  void Fit(Bytes& buffer, size_t size);
  // Chunk c's values in the output, as bytes (UseFloat32Bodies with a plain fp32 output).
  absl::Span<uint8_t> OutputBody(int chunk) const;

  // A message buffer and its PayloadChecksum, where known (ChecksumMessages, or received with it).
  struct Message {
    Bytes bytes;
    std::optional<uint64_t> sum;
  };
  void Give(std::map<int, Message>& messages, int chunk);

  const kernels::Codec& codec_;
  std::vector<kernels::ChunkRef> chunks_;  // chunk c's elements
  const Schedule& schedule_;
  const kernels::BucketPlan& plan_;
  kernels::Source local_;
  kernels::Dest out_;
  int rank_;
  int n_;
  // Per step, this rank's transfers (see ReduceScatterSends).
  std::vector<std::vector<Transfer>> rs_send_, rs_recv_, ag_send_, ag_recv_;
  std::vector<int> children_left_;                  // per chunk: receives still to come
  std::vector<int> forwards_left_;                  // per chunk: all-gather sends still in flight or to come
  std::vector<kernels::ChunkRef> compress_ref_;     // per chunk, see CompressRef
  std::map<int, std::vector<float>> accumulators_;  // chunks with several children
  BufferPool own_pool_;                             // when the caller gives none
  BufferPool* pool_;
  std::map<int, Message> pending_;  // reduce-scatter: partial sums re-encoded, waiting to be sent
  std::map<int, Message> sending_;  // reduce-scatter: sent, until Sent (each chunk leaves a rank once)
  std::map<int, Message> final_;    // all-gather: received final bytes, until forwarded
  int owned_chunk_;
  Message owned_;
  bool checksum_messages_ = false;
  std::optional<uint64_t> sent_sum_;
  // UseFloat32Bodies: first sends' bodies from the input; bodies in the output (the owned chunk
  // once its sum is there, all-gather receives).
  bool bodies_from_local_ = false, bodies_in_out_ = false, owned_in_out_ = false;
  absl::Span<const uint8_t> sent_body_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_RANK_EXECUTOR_H_
