#include "engine/rank_executor.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/payload_checksum.h"
#include "kernels/wire_format.h"

namespace dynamiq::engine {

using kernels::ChunkRef;

RankExecutor::RankExecutor(const kernels::Codec& codec, const Schedule& schedule, const kernels::BucketPlan& plan,
                           const kernels::Source& local, const kernels::Dest& out, BufferPool* pool,
                           std::vector<kernels::ChunkRef> chunks)
    : codec_(codec),
      chunks_(std::move(chunks)),
      schedule_(schedule),
      plan_(plan),
      local_(local),
      out_(out),
      rank_(static_cast<int>(plan.round.rank)),
      n_(schedule.world_size),
      children_left_(schedule.world_size, 0),
      own_pool_(0),
      pool_(pool != nullptr ? pool : &own_pool_),
      owned_chunk_(-1) {
  if (chunks_.size() != static_cast<size_t>(n_)) {
    chunks_.resize(n_);
    for (int c = 0; c < n_; ++c) chunks_[c] = ChunkOf(plan.num_elements, n_, c);
  }
  auto index = [&](const std::vector<std::vector<Transfer>>& steps, std::vector<Move>& send, std::vector<Move>& recv) {
    send.assign(steps.size(), Move{});
    recv.assign(steps.size(), Move{});
    for (size_t s = 0; s < steps.size(); ++s) {
      for (const Transfer& t : steps[s]) {
        if (t.from == rank_) send[s] = Move{t.chunk, t.to};
        if (t.to == rank_) recv[s] = Move{t.chunk, t.from};
      }
    }
  };
  index(schedule.reduce_scatter, rs_send_, rs_recv_);
  index(schedule.all_gather, ag_send_, ag_recv_);
  for (const Move& m : rs_recv_) {
    if (m.chunk >= 0) ++children_left_[m.chunk];
  }
  for (int c = 0; c < n_; ++c) {
    if (schedule.owner[c] == rank_) owned_chunk_ = c;
  }
  compress_ref_.resize(n_);
  for (int c = 0; c < n_; ++c) compress_ref_[c] = chunks_[c];
  for (const Move& m : rs_send_) {
    if (m.chunk >= 0) compress_ref_[m.chunk] = SiblingRef(schedule, chunks_[m.chunk], m.chunk, rank_, m.peer);
  }
}

void RankExecutor::Fit(Bytes& buffer, size_t size) {
  if (buffer.capacity() < size) {
    pool_->Give(std::move(buffer));
    buffer = pool_->Take(size);
  }
  buffer.resize(size);
}

RankExecutor::~RankExecutor() {
  for (auto& [chunk, bytes] : pending_) pool_->Give(std::move(bytes));
  pool_->Give(std::move(scratch_));
  pool_->Give(std::move(owned_));
  pool_->Give(std::move(forward_));
}

void RankExecutor::UseFloat32Bodies() {
  if (!codec_.BodyIsFloat32() || !checksum_messages_) return;
  bodies_from_local_ = kernels::PlainFloats(local_, local_.first) != nullptr;
  bodies_in_out_ = kernels::PlainFloats(out_, out_.first) != nullptr;
}

absl::Span<uint8_t> RankExecutor::OutputBody(int chunk) const {
  const ChunkRef& c = chunks_[chunk];
  return {reinterpret_cast<uint8_t*>(kernels::PlainFloats(out_, c.begin)), sizeof(float) * c.count};
}

absl::Span<uint8_t> RankExecutor::AllGatherRecvBody(int step) const {
  const int chunk = ag_recv_[step].chunk;
  if (!bodies_in_out_ || chunk < 0) return {};
  return OutputBody(chunk);
}

kernels::ChunkRef RankExecutor::CompressRef(int chunk) const {
  return chunk == owned_chunk_ ? chunks_[chunk] : compress_ref_[chunk];
}

size_t RankExecutor::MaxMessageBytes(int chunk) const { return codec_.MaxEncodedBytes(plan_, chunks_[chunk]); }

kernels::Source RankExecutor::AccumulatorSource(int chunk) const {
  kernels::Source s;
  s.data = accumulators_.at(chunk).data();
  s.dtype = kernels::DType::kFloat32;
  s.first = chunks_[chunk].begin;
  return s;
}

absl::StatusOr<absl::Span<const uint8_t>> RankExecutor::ReduceScatterSend(int step) {
  const Move m = rs_send_[step];
  sent_sum_.reset();
  sent_body_ = {};
  if (m.chunk < 0) return absl::Span<const uint8_t>();
  const ChunkRef chunk = chunks_[m.chunk];
  auto it = pending_.find(m.chunk);
  if (it != pending_.end()) {
    pool_->Give(std::move(scratch_));
    scratch_ = std::move(it->second);
    pending_.erase(it);
    scratch_sum_ = sent_sum_ = pending_sums_[m.chunk];
    pending_sums_.erase(m.chunk);
    return absl::Span<const uint8_t>(scratch_);
  }
  if (children_left_[m.chunk] != 0) {
    return absl::InternalError(
        absl::StrCat("rank ", rank_, " must send chunk ", m.chunk, " at step ", step, " before its children arrived"));
  }
  const ChunkRef ref = CompressRef(m.chunk);
  scratch_sum_.reset();
  if (bodies_from_local_) {  // the header, then the input's values as they are
    Fit(scratch_, kernels::kChunkHeaderBytes);
    DQ_RETURN_IF_ERROR(codec_.WriteFloat32Head(plan_, ref, absl::MakeSpan(scratch_)));
    sent_body_ = {reinterpret_cast<const uint8_t*>(kernels::PlainFloats(local_, chunk.begin)),
                  sizeof(float) * chunk.count};
    scratch_sum_ = sent_sum_ = kernels::PayloadChecksum(scratch_, sent_body_);
    return absl::Span<const uint8_t>(scratch_);
  }
  Fit(scratch_, codec_.MaxEncodedBytes(plan_, chunk));
  size_t bytes = 0;
  if (checksum_messages_) {
    uint64_t sum = 0;
    DQ_ASSIGN_OR_RETURN(bytes, codec_.CompressChecksummed(plan_, ref, local_, absl::MakeSpan(scratch_), sum));
    scratch_sum_ = sent_sum_ = sum;
  } else {
    DQ_ASSIGN_OR_RETURN(bytes, codec_.Compress(plan_, ref, local_, absl::MakeSpan(scratch_)));
  }
  return absl::Span<const uint8_t>(scratch_.data(), bytes);
}

absl::Status RankExecutor::ReduceScatterReceive(int step, absl::Span<const uint8_t> message,
                                                std::optional<uint64_t> verify) {
  const Move m = rs_recv_[step];
  if (m.chunk < 0) return absl::OkStatus();
  const ChunkRef chunk = chunks_[m.chunk];
  const bool last = --children_left_[m.chunk] == 0;
  // Verified here unless the DAR below verifies it as it decodes.
  if (verify.has_value() && !(last && checksum_messages_) && kernels::PayloadChecksum(message) != *verify) {
    const absl::Status bad = kernels::PayloadChecksumError();
    return common::Annotate(bad, absl::StrCat("from rank ", m.peer, ", chunk ", m.chunk));
  }
  if (!last) {
    auto [it, fresh] = accumulators_.try_emplace(m.chunk);
    if (fresh) {
      it->second.resize(chunk.count);
      kernels::LoadSource(local_, chunk.begin, chunk.count, it->second.data());
    }
    absl::Status s = codec_.DecompressAccumulate(plan_, chunk, message, it->second.data());
    if (!s.ok()) {
      return common::Annotate(s, absl::StrCat("from rank ", m.peer, ", chunk ", m.chunk));
    }
    return absl::OkStatus();
  }
  const bool accumulated = accumulators_.count(m.chunk) != 0;
  const kernels::Source source = accumulated ? AccumulatorSource(m.chunk) : local_;
  const size_t max_bytes = codec_.MaxEncodedBytes(plan_, chunk);
  const bool owned = m.chunk == owned_chunk_;
  if (owned && bodies_in_out_) {  // the final sum straight into the output, its header into owned_
    Fit(owned_, kernels::kChunkHeaderBytes);
    uint64_t sum = 0;
    absl::Status s =
        codec_.DecompressAccumulateRecompressSplit(plan_, chunk, message, verify, source, absl::MakeSpan(owned_),
                                                   reinterpret_cast<float*>(OutputBody(m.chunk).data()), sum);
    if (accumulated) accumulators_.erase(m.chunk);
    if (!s.ok()) return common::Annotate(s, absl::StrCat("from rank ", m.peer, ", chunk ", m.chunk));
    owned_sum_ = sum;
    owned_in_out_ = true;
    return absl::OkStatus();
  }
  Bytes* target = owned ? &owned_ : &pending_[m.chunk];
  std::optional<uint64_t>& target_sum = owned ? owned_sum_ : pending_sums_[m.chunk];
  Fit(*target, max_bytes);
  target_sum.reset();
  absl::StatusOr<size_t> bytes;
  if (checksum_messages_) {
    uint64_t sum = 0;
    bytes = verify.has_value()
                ? codec_.DecompressAccumulateRecompressVerified(plan_, CompressRef(m.chunk), message, *verify, source,
                                                                absl::MakeSpan(*target), sum)
                : codec_.DecompressAccumulateRecompressChecksummed(plan_, CompressRef(m.chunk), message, source,
                                                                   absl::MakeSpan(*target), sum);
    if (bytes.ok()) target_sum = sum;
  } else {
    bytes =
        codec_.DecompressAccumulateRecompress(plan_, CompressRef(m.chunk), message, source, absl::MakeSpan(*target));
  }
  if (accumulated) accumulators_.erase(m.chunk);
  if (!bytes.ok()) {
    return common::Annotate(bytes.status(), absl::StrCat("from rank ", m.peer, ", chunk ", m.chunk));
  }
  target->resize(*bytes);
  return absl::OkStatus();
}

absl::Status RankExecutor::FinishReduceScatter() {
  if (owned_chunk_ < 0) return absl::OkStatus();
  if (owned_in_out_) return absl::OkStatus();  // the output holds the values already
  const ChunkRef chunk = chunks_[owned_chunk_];
  if (owned_.empty()) {  // no children (world size 1): the owner is also the leaf
    Fit(owned_, codec_.MaxEncodedBytes(plan_, chunk));
    DQ_ASSIGN_OR_RETURN(size_t bytes, codec_.Compress(plan_, chunk, local_, absl::MakeSpan(owned_)));
    owned_.resize(bytes);
  }
  // The owner decodes its own compressed copy, exactly what every other rank will decode.
  return codec_.Decompress(plan_, chunk, owned_, out_);
}

absl::StatusOr<absl::Span<const uint8_t>> RankExecutor::AllGatherSend(int step) {
  const Move m = ag_send_[step];
  sent_sum_.reset();
  sent_body_ = {};
  if (m.chunk < 0) return absl::Span<const uint8_t>();
  if (m.chunk == owned_chunk_) {
    sent_sum_ = owned_sum_;
    if (owned_in_out_) sent_body_ = OutputBody(m.chunk);
    return absl::Span<const uint8_t>(owned_);
  }
  scratch_.swap(forward_);  // the next receive refills forward_ while this send may be in flight
  scratch_sum_.swap(forward_sum_);
  sent_sum_ = scratch_sum_;
  sent_body_ = forward_body_;
  return absl::Span<const uint8_t>(scratch_);
}

absl::Status RankExecutor::AllGatherReceive(int step, absl::Span<const uint8_t> message) {
  Bytes copy = pool_->Take(message.size());
  copy.assign(message.begin(), message.end());
  return AllGatherReceive(step, std::move(copy));
}

absl::Status RankExecutor::AllGatherReceive(int step, Bytes message, std::optional<uint64_t> checksum, bool verify) {
  const Move m = ag_recv_[step];
  if (m.chunk < 0) {
    pool_->Give(std::move(message));
    return absl::OkStatus();
  }
  const ChunkRef chunk = chunks_[m.chunk];
  // With bodies in the output, `message` is the header of a message whose values are already there
  // (AllGatherRecvBody; the messenger verified the checksum of both): nothing to decode.
  absl::Status s = bodies_in_out_                   ? codec_.CheckFloat32Head(plan_, chunk, message)
                   : verify && checksum.has_value() ? codec_.DecompressVerified(plan_, chunk, message, out_, *checksum)
                                                    : codec_.Decompress(plan_, chunk, message, out_);
  pool_->Give(std::move(forward_));
  forward_ = std::move(message);
  forward_sum_ = checksum;
  forward_body_ = bodies_in_out_ ? OutputBody(m.chunk) : absl::Span<uint8_t>();
  if (!s.ok()) {
    return common::Annotate(s, absl::StrCat("all-gather from rank ", m.peer, ", chunk ", m.chunk));
  }
  return absl::OkStatus();
}

}  // namespace dynamiq::engine
