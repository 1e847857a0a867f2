#include "engine/lossy_all_reduce.h"

#include <string.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/bf16_math.h"

namespace dynamiq::engine {
namespace {

constexpr size_t kHeaderBytes = 24;  // u64 first element, u32 count, u32 contributors, u64 announcement

void Put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t Get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// The elements rank c owns: [Begin(c), Begin(c + 1)).
struct Chunks {
  size_t elements;
  int ranks;
  size_t Begin(int c) const {
    return static_cast<size_t>((static_cast<unsigned __int128>(elements) * c) / static_cast<unsigned>(ranks));
  }
  size_t End(int c) const { return Begin(c + 1); }
  size_t Slices(int c, size_t per) const { return (End(c) - Begin(c) + per - 1) / per; }
};

// One parsed datagram: `count` values for elements [first, first + count).
struct Slice {
  uint64_t first = 0;
  uint32_t count = 0;
  uint32_t contributors = 0;
  const uint8_t* values = nullptr;
};

// The slice index of `s` in chunk [begin, end) cut every `per` elements, or -1 when `s` is not
// exactly one of its slices.
int64_t SliceIndex(const Slice& s, size_t begin, size_t end, size_t per) {
  if (s.first < begin || s.first >= end || (s.first - begin) % per != 0) return -1;
  if (s.count != std::min<uint64_t>(per, end - s.first)) return -1;
  return static_cast<int64_t>((s.first - begin) / per);
}

}  // namespace

std::optional<LossyValues> LossyValuesOf(kernels::CodecId codec) {
  switch (codec) {
    case kernels::CodecId::kNone:
      return LossyValues::kFp32;
    case kernels::CodecId::kBf16:
      return LossyValues::kBf16;
    case kernels::CodecId::kInt8:
      return LossyValues::kInt8;
    default:
      return std::nullopt;
  }
}

absl::StatusOr<LossyAllReduceResult> LossyAllReduceMean(DatagramTransport& transport,
                                                        const LossyAllReduceOptions& options,
                                                        absl::Span<const float> input, absl::Span<float> output) {
  if (input.size() != output.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("lossy all-reduce of ", input.size(), " elements into ", output.size()));
  }
  const size_t max_payload = transport.capabilities().max_payload;
  const LossyValues kind = options.values;
  const size_t value_bytes = kind == LossyValues::kFp32 ? 4 : kind == LossyValues::kBf16 ? 2 : 1;
  const size_t scale_bytes = kind == LossyValues::kInt8 ? 4 : 0;  // before the codes
  if (max_payload < kHeaderBytes + scale_bytes + value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("datagrams of ", max_payload, " payload bytes cannot carry one element"));
  }
  const int n = transport.size();
  const int me = transport.rank();
  LossyAllReduceResult result;
  // Own values first: they stay wherever the all-gather brings nothing. Output may be input: every
  // read of the input (the sends, the owner's own values) comes before any write of the output.
  if (output.data() != input.data()) std::copy(input.begin(), input.end(), output.begin());
  result.expected_from.assign(n, 0);
  result.arrived_from.assign(n, 0);
  if (n == 1 || input.empty()) return result;

  const size_t per = (max_payload - kHeaderBytes - scale_bytes) / value_bytes;  // elements per datagram
  auto slice_bytes = [&](size_t count) { return scale_bytes + value_bytes * count; };
  // A slice's values as they travel (at `p`), and back.
  auto encode = [&](uint8_t* p, absl::Span<const float> values) {
    if (kind == LossyValues::kInt8) {
      float largest = 0;
      bool finite = true;
      for (float v : values) {
        finite = finite && std::isfinite(v);
        largest = std::max(largest, std::fabs(v));
      }
      // A non-finite value makes the whole slice NaN: the sum shows it, as an fp32 one would.
      const float scale = finite ? largest / 127 : std::numeric_limits<float>::quiet_NaN();
      uint32_t bits;
      memcpy(&bits, &scale, sizeof(bits));
      Put32(p, bits);
      for (size_t i = 0; i < values.size(); ++i) {
        const float code = scale > 0 ? std::nearbyint(values[i] / scale) : 0.0f;  // NaN scale: 0
        p[4 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(code, -127.0f, 127.0f)));
      }
      return;
    }
    for (size_t i = 0; i < values.size(); ++i) {
      if (kind == LossyValues::kBf16) {
        const uint16_t h = kernels::FloatToBf16(values[i]);
        p[2 * i] = static_cast<uint8_t>(h);
        p[2 * i + 1] = static_cast<uint8_t>(h >> 8);
      } else {
        uint32_t bits;
        memcpy(&bits, &values[i], sizeof(bits));
        Put32(p + 4 * i, bits);
      }
    }
  };
  // False for an int8 scale that no encoder writes (negative or infinite).
  auto decodable = [&](const uint8_t* p) {
    if (kind != LossyValues::kInt8) return true;
    const uint32_t bits = Get32(p);
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return !(scale < 0) && !std::isinf(scale);
  };
  auto decode = [&](const uint8_t* p, size_t count, float* out) {
    if (kind == LossyValues::kInt8) {
      const uint32_t bits = Get32(p);
      float scale;
      memcpy(&scale, &bits, sizeof(scale));
      for (size_t i = 0; i < count; ++i) out[i] = static_cast<float>(static_cast<int8_t>(p[4 + i])) * scale;
      return;
    }
    for (size_t i = 0; i < count; ++i) {
      if (kind == LossyValues::kBf16) {
        out[i] = kernels::Bf16ToFloat(static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8)));
      } else {
        const uint32_t bits = Get32(p + 4 * i);
        memcpy(&out[i], &bits, sizeof(float));
      }
    }
  };
  // `values` (one slice) as its datagram carries them.
  std::vector<uint8_t> scratch(max_payload);
  auto round_trip = [&](absl::Span<float> values) {
    if (kind == LossyValues::kFp32) return;
    encode(scratch.data(), values);
    decode(scratch.data(), values.size(), values.data());
  };
  const Chunks chunks{input.size(), n};
  const uint64_t tag0 = 2 * options.sequence, tag1 = tag0 + 1;
  transport.AcceptTags(tag0, tag1);
  std::vector<uint8_t> outgoing(max_payload), incoming(max_payload);

  const size_t my_begin = chunks.Begin(me), my_end = chunks.End(me);
  const size_t my_slices = chunks.Slices(me, per);
  std::vector<double> sum(my_end - my_begin);
  {
    // My own contribution as a datagram would carry it, slice by slice.
    std::vector<float> own(input.begin() + my_begin, input.begin() + my_end);
    for (size_t first = 0; first < own.size(); first += per) {
      round_trip(absl::MakeSpan(own).subspan(first, std::min(per, own.size() - first)));
    }
    std::copy(own.begin(), own.end(), sum.begin());
  }
  std::vector<float> decoded(per);
  std::vector<uint32_t> count(my_slices, 1);                                // my own contribution
  std::vector<std::vector<bool>> counted(n, std::vector<bool>(my_slices));  // [source][slice]
  std::vector<std::vector<bool>> gathered(n);                               // [owner][slice]
  std::vector<bool> heard(n, false);
  for (int c = 0; c < n; ++c) {
    if (c != me) gathered[c].assign(chunks.Slices(c, per), false);
  }
  result.contributions_expected = static_cast<uint64_t>(n - 1) * my_slices;
  for (int c = 0; c < n; ++c) {
    if (c == me) continue;
    result.gathered_expected += chunks.Slices(c, per);
    result.expected_from[c] = my_slices + chunks.Slices(c, per);
  }
  bool reduced = false;  // the first phase ended: this rank's means went out

  // Counts one received datagram (in `incoming`) where it belongs, or drops it.
  auto take = [&](const ReceivedDatagram& got) {
    Slice s;
    if (got.bytes < kHeaderBytes) {
      ++result.rejected;
      return;
    }
    s.first = Get64(incoming.data());
    s.count = Get32(incoming.data() + 8);
    s.contributors = Get32(incoming.data() + 12);
    s.values = incoming.data() + kHeaderBytes;
    if (s.count == 0 || s.count > per || got.bytes != kHeaderBytes + slice_bytes(s.count) || !decodable(s.values) ||
        s.contributors == 0 || s.contributors > static_cast<uint32_t>(n) || got.source < 0 || got.source >= n ||
        got.source == me) {
      ++result.rejected;
      return;
    }
    // Parsed and of this call: whatever becomes of its values, its sender was heard.
    if (!heard[got.source]) {
      heard[got.source] = true;
      ++result.ranks_heard;
    }
    result.highest_announcement = std::max(result.highest_announcement, Get64(incoming.data() + 16));
    if (got.tag == tag0) {
      const int64_t slice = SliceIndex(s, my_begin, my_end, per);
      if (slice < 0 || s.contributors != 1 || counted[got.source][slice]) {
        ++result.rejected;
        return;
      }
      counted[got.source][slice] = true;
      if (reduced) {  // late: the means have gone out without it
        ++result.late;
        return;
      }
      ++result.contributions_arrived;
      ++result.arrived_from[got.source];
      ++count[slice];
      decode(s.values, s.count, decoded.data());
      for (uint32_t i = 0; i < s.count; ++i) sum[s.first - my_begin + i] += decoded[i];
    } else {
      const int owner = got.source;
      const int64_t slice = SliceIndex(s, chunks.Begin(owner), chunks.End(owner), per);
      if (slice < 0 || gathered[owner][slice]) {
        ++result.rejected;
        return;
      }
      gathered[owner][slice] = true;
      ++result.gathered_arrived;
      ++result.arrived_from[owner];
      decode(s.values, s.count, output.data() + s.first);
    }
  };
  // Takes what arrives until `until` (what is waiting, when it has passed), or until `*arrived`
  // reaches `expected`: while this rank sends, so that the peers' datagrams are counted as they
  // come rather than left in the socket's buffer, and for each phase's wait.
  auto receive_until = [&](absl::Time until, const uint64_t* arrived = nullptr, uint64_t expected = 0) -> absl::Status {
    // A phase's wait ends at its deadline even while datagrams keep coming.
    while (arrived == nullptr || (*arrived < expected && absl::Now() < until)) {
      absl::StatusOr<ReceivedDatagram> got = transport.Receive(absl::MakeSpan(incoming), until);
      if (absl::IsDeadlineExceeded(got.status())) return absl::OkStatus();
      if (!got.ok()) return got.status();
      take(*got);
    }
    return absl::OkStatus();
  };

  // Sends `values` (elements from `first` on) to `peer` in slices; a refused send is a lost one.
  // With a rate, a datagram waits until the bytes sent so far in this phase are due (no credit
  // carries over from the wait between the phases: that would be a burst), receiving meanwhile.
  constexpr int kSendsPerReceive = 32;  // without a rate: take what arrived every so many sends
  int sends = 0;
  absl::Time paced_from = absl::Now();
  uint64_t paced_bytes = 0;
  auto send_slices = [&](int peer, uint64_t tag, size_t first, absl::Span<const float> values,
                         const std::vector<uint32_t>* contributors) -> absl::Status {
    for (size_t s = 0; s * per < values.size(); ++s) {
      if (options.send_bytes_per_second > 0) {
        DQ_RETURN_IF_ERROR(receive_until(
            paced_from + absl::Seconds(static_cast<double>(paced_bytes) / options.send_bytes_per_second)));
      } else if (++sends % kSendsPerReceive == 0) {
        DQ_RETURN_IF_ERROR(receive_until(absl::InfinitePast()));
      }
      const size_t count = std::min(per, values.size() - s * per);
      Put64(outgoing.data(), first + s * per);
      Put32(outgoing.data() + 8, static_cast<uint32_t>(count));
      Put32(outgoing.data() + 12, contributors == nullptr ? 1u : (*contributors)[s]);
      Put64(outgoing.data() + 16, options.announcement);
      encode(outgoing.data() + kHeaderBytes, values.subspan(s * per, count));
      const size_t bytes = kHeaderBytes + slice_bytes(count);
      absl::Status sent = transport.Send(peer, tag, absl::MakeConstSpan(outgoing.data(), bytes));
      paced_bytes += bytes;
      if (absl::IsAborted(sent)) return sent;
      if (!sent.ok()) {
        ++result.send_failures;
      } else {
        result.bytes_sent += bytes;
      }
    }
    return absl::OkStatus();
  };

  // 1. Reduce-scatter: my values of every other chunk to its owner; the phase ends phase_timeout
  // after the last of them left, or once every contribution to my chunk arrived.
  for (int k = 1; k < n; ++k) {
    const int c = (me + k) % n;  // each rank starts with a different owner
    DQ_RETURN_IF_ERROR(send_slices(c, tag0, chunks.Begin(c),
                                   input.subspan(chunks.Begin(c), chunks.End(c) - chunks.Begin(c)), nullptr));
  }
  const absl::Time scattered = absl::Now();
  DQ_RETURN_IF_ERROR(
      receive_until(scattered + options.phase_timeout, &result.contributions_arrived, result.contributions_expected));

  // 2. All-gather: the owner's means, to every rank; the phase ends phase_timeout after the last
  // of them left, but not before twice phase_timeout after the first phase's sends, or once every
  // other owner's means arrived. An owner that missed a contribution sends its means only at its
  // first deadline; a rank whose first phase ended early (nothing missing) would otherwise stop
  // waiting just as those means come, and lose a whole chunk to a race for every lost datagram.
  reduced = true;
  for (size_t i = 0; i < sum.size(); ++i) {
    const double by = options.normalize ? count[i / per] : n;
    output[my_begin + i] = static_cast<float>(sum[i] / by);
  }
  // The means as the receivers decode them, so that every rank holds the same values.
  for (size_t first = my_begin; first < my_end; first += per) {
    round_trip(output.subspan(first, std::min(per, my_end - first)));
  }
  const absl::Span<const float> means = output.subspan(my_begin, my_end - my_begin);
  paced_from = absl::Now();
  paced_bytes = 0;
  for (int k = 1; k < n; ++k) DQ_RETURN_IF_ERROR(send_slices((me + k) % n, tag1, my_begin, means, &count));
  const absl::Time gathered_by = std::max(absl::Now() + options.phase_timeout, scattered + 2 * options.phase_timeout);
  DQ_RETURN_IF_ERROR(receive_until(gathered_by, &result.gathered_arrived, result.gathered_expected));
  for (int c = 0; c < n; ++c) {
    if (c == me) continue;
    for (size_t slice = 0; slice < gathered[c].size(); ++slice) {
      if (!gathered[c][slice]) result.kept_own_elements += std::min(per, chunks.End(c) - chunks.Begin(c) - slice * per);
    }
  }
  return result;
}

}  // namespace dynamiq::engine
