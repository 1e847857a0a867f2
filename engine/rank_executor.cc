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
      forwards_left_(schedule.world_size, 0),
      own_pool_(0),
      pool_(pool != nullptr ? pool : &own_pool_),
      owned_chunk_(-1) {
  if (chunks_.size() != static_cast<size_t>(n_)) {
    chunks_.resize(n_);
    for (int c = 0; c < n_; ++c) chunks_[c] = ChunkOf(plan.num_elements, n_, c);
  }
  auto index = [&](const std::vector<std::vector<Transfer>>& steps, std::vector<std::vector<Transfer>>& send,
                   std::vector<std::vector<Transfer>>& recv) {
    send.assign(steps.size(), {});
    recv.assign(steps.size(), {});
    for (size_t s = 0; s < steps.size(); ++s) {
      for (const Transfer& t : steps[s]) {
        if (t.from == rank_) send[s].push_back(t);
        if (t.to == rank_) recv[s].push_back(t);
      }
    }
  };
  index(schedule.reduce_scatter, rs_send_, rs_recv_);
  index(schedule.all_gather, ag_send_, ag_recv_);
  for (const auto& step : rs_recv_) {
    for (const Transfer& t : step) ++children_left_[t.chunk];
  }
  for (const auto& step : ag_send_) {
    for (const Transfer& t : step) ++forwards_left_[t.chunk];
  }
  for (int c = 0; c < n_; ++c) {
    if (schedule.owner[c] == rank_) owned_chunk_ = c;
  }
  compress_ref_.resize(n_);
  for (int c = 0; c < n_; ++c) compress_ref_[c] = chunks_[c];
  for (const auto& step : rs_send_) {
    for (const Transfer& t : step)
      compress_ref_[t.chunk] = SiblingRef(schedule, chunks_[t.chunk], t.chunk, rank_, t.to);
  }
}

void RankExecutor::Fit(Bytes& buffer, size_t size) {
  if (buffer.capacity() < size) {
    pool_->Give(std::move(buffer));
    buffer = pool_->Take(size);
  }
  buffer.resize(size);
}

void RankExecutor::Give(std::map<int, Message>& messages, int chunk) {
  auto it = messages.find(chunk);
  if (it == messages.end()) return;
  pool_->Give(std::move(it->second.bytes));
  messages.erase(it);
}

RankExecutor::~RankExecutor() {
  for (auto* messages : {&pending_, &sending_, &final_}) {
    for (auto& [chunk, message] : *messages) pool_->Give(std::move(message.bytes));
  }
  pool_->Give(std::move(owned_.bytes));
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

absl::Span<uint8_t> RankExecutor::AllGatherRecvBody(int step, int i) const {
  if (!bodies_in_out_) return {};
  return OutputBody(ag_recv_[step][i].chunk);
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

bool RankExecutor::ReduceScatterSendReady(int step, int i) const {
  return children_left_[rs_send_[step][i].chunk] == 0;
}

bool RankExecutor::AllGatherSendReady(int step, int i) const {
  const int chunk = ag_send_[step][i].chunk;
  return chunk == owned_chunk_ ? children_left_[chunk] == 0 : final_.count(chunk) != 0;
}

absl::StatusOr<absl::Span<const uint8_t>> RankExecutor::ReduceScatterSend(int step, int i) {
  const Transfer& t = rs_send_[step][i];
  sent_sum_.reset();
  sent_body_ = {};
  const ChunkRef chunk = chunks_[t.chunk];
  if (sending_.count(t.chunk) != 0) {
    return absl::InternalError(absl::StrCat("rank ", rank_, " sends chunk ", t.chunk, " twice"));
  }
  auto it = pending_.find(t.chunk);
  if (it != pending_.end()) {  // a partial sum, re-encoded when its last child arrived
    Message& m = sending_[t.chunk] = std::move(it->second);
    pending_.erase(it);
    sent_sum_ = m.sum;
    return absl::Span<const uint8_t>(m.bytes);
  }
  if (children_left_[t.chunk] != 0) {
    return absl::InternalError(
        absl::StrCat("rank ", rank_, " must send chunk ", t.chunk, " at step ", step, " before its children arrived"));
  }
  const ChunkRef ref = CompressRef(t.chunk);
  Message& m = sending_[t.chunk];
  if (bodies_from_local_) {  // the header, then the input's values as they are
    Fit(m.bytes, kernels::kChunkHeaderBytes);
    DQ_RETURN_IF_ERROR(codec_.WriteFloat32Head(plan_, ref, absl::MakeSpan(m.bytes)));
    sent_body_ = {reinterpret_cast<const uint8_t*>(kernels::PlainFloats(local_, chunk.begin)),
                  sizeof(float) * chunk.count};
    m.sum = sent_sum_ = kernels::PayloadChecksum(m.bytes, sent_body_);
    return absl::Span<const uint8_t>(m.bytes);
  }
  Fit(m.bytes, codec_.MaxEncodedBytes(plan_, chunk));
  size_t bytes = 0;
  if (checksum_messages_) {
    uint64_t sum = 0;
    DQ_ASSIGN_OR_RETURN(bytes, codec_.CompressChecksummed(plan_, ref, local_, absl::MakeSpan(m.bytes), sum));
    m.sum = sent_sum_ = sum;
  } else {
    DQ_ASSIGN_OR_RETURN(bytes, codec_.Compress(plan_, ref, local_, absl::MakeSpan(m.bytes)));
  }
  m.bytes.resize(bytes);
  return absl::Span<const uint8_t>(m.bytes);
}

void RankExecutor::ReduceScatterSent(int step, int i) { Give(sending_, rs_send_[step][i].chunk); }

absl::Status RankExecutor::ReduceScatterReceive(int step, int i, absl::Span<const uint8_t> message,
                                                std::optional<uint64_t> verify) {
  const Transfer& t = rs_recv_[step][i];
  const ChunkRef chunk = chunks_[t.chunk];
  const auto annotate = [&](const absl::Status& s) {
    return common::Annotate(s, absl::StrCat("from rank ", t.from, ", chunk ", t.chunk));
  };
  if (children_left_[t.chunk] <= 0) {
    return absl::InternalError(absl::StrCat("rank ", rank_, " receives chunk ", t.chunk, " after its last child"));
  }
  const bool last = --children_left_[t.chunk] == 0;
  // Verified here unless the DAR below verifies it as it decodes.
  if (verify.has_value() && !(last && checksum_messages_) && kernels::PayloadChecksum(message) != *verify) {
    return annotate(kernels::PayloadChecksumError());
  }
  if (!last) {
    auto [it, fresh] = accumulators_.try_emplace(t.chunk);
    if (fresh) {
      it->second.resize(chunk.count);
      kernels::LoadSource(local_, chunk.begin, chunk.count, it->second.data());
    }
    absl::Status s = codec_.DecompressAccumulate(plan_, chunk, message, it->second.data());
    if (!s.ok()) return annotate(s);
    return absl::OkStatus();
  }
  const bool accumulated = accumulators_.count(t.chunk) != 0;
  const kernels::Source source = accumulated ? AccumulatorSource(t.chunk) : local_;
  const size_t max_bytes = codec_.MaxEncodedBytes(plan_, chunk);
  const bool owned = t.chunk == owned_chunk_;
  if (owned && bodies_in_out_) {  // the final sum straight into the output, its header into owned_
    Fit(owned_.bytes, kernels::kChunkHeaderBytes);
    uint64_t sum = 0;
    absl::Status s =
        codec_.DecompressAccumulateRecompressSplit(plan_, chunk, message, verify, source, absl::MakeSpan(owned_.bytes),
                                                   reinterpret_cast<float*>(OutputBody(t.chunk).data()), sum);
    if (accumulated) accumulators_.erase(t.chunk);
    if (!s.ok()) return annotate(s);
    owned_.sum = sum;
    owned_in_out_ = true;
    return absl::OkStatus();
  }
  Message& target = owned ? owned_ : pending_[t.chunk];
  Fit(target.bytes, max_bytes);
  target.sum.reset();
  absl::StatusOr<size_t> bytes;
  if (checksum_messages_) {
    uint64_t sum = 0;
    bytes = verify.has_value()
                ? codec_.DecompressAccumulateRecompressVerified(plan_, CompressRef(t.chunk), message, *verify, source,
                                                                absl::MakeSpan(target.bytes), sum)
                : codec_.DecompressAccumulateRecompressChecksummed(plan_, CompressRef(t.chunk), message, source,
                                                                   absl::MakeSpan(target.bytes), sum);
    if (bytes.ok()) target.sum = sum;
  } else {
    bytes = codec_.DecompressAccumulateRecompress(plan_, CompressRef(t.chunk), message, source,
                                                  absl::MakeSpan(target.bytes));
  }
  if (accumulated) accumulators_.erase(t.chunk);
  if (!bytes.ok()) return annotate(bytes.status());
  target.bytes.resize(*bytes);
  return absl::OkStatus();
}

absl::Status RankExecutor::FinishReduceScatter() {
  if (owned_chunk_ < 0) return absl::OkStatus();
  if (owned_in_out_) return absl::OkStatus();  // the output holds the values already
  const ChunkRef chunk = chunks_[owned_chunk_];
  if (owned_.bytes.empty()) {  // no children (world size 1): the owner is also the leaf
    Fit(owned_.bytes, codec_.MaxEncodedBytes(plan_, chunk));
    DQ_ASSIGN_OR_RETURN(size_t bytes, codec_.Compress(plan_, chunk, local_, absl::MakeSpan(owned_.bytes)));
    owned_.bytes.resize(bytes);
  }
  // The owner decodes its own compressed copy, exactly what every other rank will decode.
  return codec_.Decompress(plan_, chunk, owned_.bytes, out_);
}

absl::StatusOr<absl::Span<const uint8_t>> RankExecutor::AllGatherSend(int step, int i) {
  const int chunk = ag_send_[step][i].chunk;
  sent_sum_.reset();
  sent_body_ = {};
  if (!AllGatherSendReady(step, i)) {
    return absl::InternalError(
        absl::StrCat("rank ", rank_, " must forward chunk ", chunk, " at all-gather step ", step, " before it has it"));
  }
  const Message& m = chunk == owned_chunk_ ? owned_ : final_.at(chunk);
  sent_sum_ = m.sum;
  // With bodies in the output: the owned chunk's once its sum is there, a received chunk's always.
  if (bodies_in_out_ && (chunk != owned_chunk_ || owned_in_out_)) sent_body_ = OutputBody(chunk);
  return absl::Span<const uint8_t>(m.bytes);
}

void RankExecutor::AllGatherSent(int step, int i) {
  const int chunk = ag_send_[step][i].chunk;
  if (chunk != owned_chunk_ && --forwards_left_[chunk] == 0) Give(final_, chunk);
}

absl::Status RankExecutor::AllGatherReceive(int step, int i, absl::Span<const uint8_t> message) {
  Bytes copy = pool_->Take(message.size());
  copy.assign(message.begin(), message.end());
  return AllGatherReceive(step, i, std::move(copy));
}

absl::Status RankExecutor::AllGatherReceive(int step, int i, Bytes message, std::optional<uint64_t> checksum,
                                            bool verify) {
  const Transfer& t = ag_recv_[step][i];
  const ChunkRef chunk = chunks_[t.chunk];
  // With bodies in the output, `message` is the header of a message whose values are already there
  // (AllGatherRecvBody; the messenger verified the checksum of both): nothing to decode.
  absl::Status s = bodies_in_out_                   ? codec_.CheckFloat32Head(plan_, chunk, message)
                   : verify && checksum.has_value() ? codec_.DecompressVerified(plan_, chunk, message, out_, *checksum)
                                                    : codec_.Decompress(plan_, chunk, message, out_);
  if (s.ok() && forwards_left_[t.chunk] > 0) {  // kept, unchanged, until its last forward has left
    Give(final_, t.chunk);
    final_[t.chunk] = Message{std::move(message), checksum};
  } else {
    pool_->Give(std::move(message));
  }
  if (!s.ok()) return common::Annotate(s, absl::StrCat("all-gather from rank ", t.from, ", chunk ", t.chunk));
  return absl::OkStatus();
}

}  // namespace dynamiq::engine
