#include "engine/side_lane.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dynamiq::engine {

std::vector<uint8_t> EncodeSideSums(absl::Span<const double> values) {
  std::vector<uint8_t> bytes(8 * values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    uint64_t bits;
    std::memcpy(&bits, &values[i], 8);
    for (int b = 0; b < 8; ++b) bytes[8 * i + b] = static_cast<uint8_t>(bits >> (8 * b));
  }
  return bytes;
}

absl::Status DecodeSideSums(absl::Span<const uint8_t> bytes, absl::Span<double> out) {
  if (bytes.size() != 8 * out.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a side lane of ", bytes.size(), " bytes, expected ", out.size(),
                                                   " values (", 8 * out.size(), " bytes)"));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    uint64_t bits = 0;
    for (int b = 0; b < 8; ++b) bits |= static_cast<uint64_t>(bytes[8 * i + b]) << (8 * b);
    std::memcpy(&out[i], &bits, 8);
  }
  return absl::OkStatus();
}

absl::Status SideLane::Start(StepMessenger& messenger, absl::Span<const double> values) {
  if (values.size() > kMaxSideSums) {
    return absl::InvalidArgumentError(
        absl::StrCat("a side lane of ", values.size(), " values; at most ", kMaxSideSums));
  }
  values_.assign(values.begin(), values.end());
  mine_ = EncodeSideSums(values);
  for (int q = 0; q < n_; ++q) {
    if (q == rank_) continue;
    // Up to the lane's bound: a peer that sends another count is named in Finish, not cut short here.
    DQ_RETURN_IF_ERROR(messenger.PostReceive(Phase::kSideLane, static_cast<uint32_t>(q), Me(), q, 8 * kMaxSideSums));
  }
  for (int q = 0; q < n_; ++q) {
    if (q == rank_) continue;
    DQ_RETURN_IF_ERROR(
        messenger.Send(Phase::kSideLane, static_cast<uint32_t>(rank_), static_cast<uint32_t>(q), q, codec_, mine_));
  }
  return absl::OkStatus();
}

absl::Status SideLane::Finish(StepMessenger& messenger, absl::Span<double> sums) {
  if (sums.size() != values_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("side lane sums of ", sums.size(), " values for ", values_.size(), " sent"));
  }
  std::vector<double> total(values_.size(), 0.0), theirs(values_.size());
  for (int q = 0; q < n_; ++q) {
    if (q == rank_) {
      for (size_t i = 0; i < total.size(); ++i) total[i] += values_[i];
      continue;
    }
    DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> bytes,
                        messenger.Receive(Phase::kSideLane, static_cast<uint32_t>(q), Me(), q, codec_));
    if (bytes.size() != mine_.size()) {
      const size_t count = bytes.size() / 8;
      messenger.Release(Phase::kSideLane, static_cast<uint32_t>(q), Me(), q);
      return absl::InvalidArgumentError(absl::StrCat("rank ", q, " sent ", count, " side-lane values (", bytes.size(),
                                                     " bytes), this rank ", values_.size()));
    }
    const absl::Status decoded = DecodeSideSums(bytes, absl::MakeSpan(theirs));
    messenger.Release(Phase::kSideLane, static_cast<uint32_t>(q), Me(), q);
    DQ_RETURN_IF_ERROR(decoded);
    for (size_t i = 0; i < total.size(); ++i) total[i] += theirs[i];
  }
  for (int q = 0; q < n_; ++q) {
    if (q != rank_) {
      DQ_RETURN_IF_ERROR(
          messenger.WaitSent(Phase::kSideLane, static_cast<uint32_t>(rank_), static_cast<uint32_t>(q), q));
    }
  }
  std::copy(total.begin(), total.end(), sums.begin());
  return absl::OkStatus();
}

}  // namespace dynamiq::engine
