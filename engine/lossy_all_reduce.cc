#include "engine/lossy_all_reduce.h"

#include <string.h>

#include <algorithm>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

absl::StatusOr<LossyAllReduceResult> LossyAllReduceMean(DatagramTransport& transport,
                                                        const LossyAllReduceOptions& options,
                                                        absl::Span<const float> input, absl::Span<float> output) {
  if (input.size() != output.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("lossy all-reduce of ", input.size(), " elements into ", output.size()));
  }
  const size_t max_payload = transport.capabilities().max_payload;
  const size_t value_bytes = options.bf16 ? 2 : 4;
  if (max_payload < kHeaderBytes + value_bytes) {
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

  const size_t per = (max_payload - kHeaderBytes) / value_bytes;  // elements per datagram
  // A value as it travels, and back: what every rank counts, its own values included.
  auto put_value = [&](uint8_t* p, float v) {
    if (options.bf16) {
      const uint16_t h = kernels::FloatToBf16(v);
      p[0] = static_cast<uint8_t>(h);
      p[1] = static_cast<uint8_t>(h >> 8);
    } else {
      uint32_t bits;
      memcpy(&bits, &v, sizeof(bits));
      Put32(p, bits);
    }
  };
  auto get_value = [&](const uint8_t* p) {
    if (options.bf16) return kernels::Bf16ToFloat(static_cast<uint16_t>(p[0] | (p[1] << 8)));
    const uint32_t bits = Get32(p);
    float v;
    memcpy(&v, &bits, sizeof(v));
    return v;
  };
  auto round_trip = [&](float v) { return options.bf16 ? kernels::Bf16ToFloat(kernels::FloatToBf16(v)) : v; };
  const Chunks chunks{input.size(), n};
  const uint64_t tag0 = 2 * options.sequence, tag1 = tag0 + 1;
  transport.AcceptTags(tag0, tag1);
  std::vector<uint8_t> datagram(max_payload);

  // Sends `values` (elements from `first` on) to `peer` in slices; a refused send is a lost one.
  // With a rate, a datagram waits until the bytes sent so far in this phase are due (no credit
  // carries over from the wait between the phases: that would be a burst).
  absl::Time paced_from = absl::Now();
  uint64_t paced_bytes = 0;
  auto send_slices = [&](int peer, uint64_t tag, size_t first, absl::Span<const float> values,
                         const std::vector<uint32_t>* contributors) -> absl::Status {
    for (size_t s = 0; s * per < values.size(); ++s) {
      if (options.send_bytes_per_second > 0) {
        const absl::Time due =
            paced_from + absl::Seconds(static_cast<double>(paced_bytes) / options.send_bytes_per_second);
        const absl::Time now = absl::Now();
        if (due > now) absl::SleepFor(due - now);
      }
      const size_t count = std::min(per, values.size() - s * per);
      Put64(datagram.data(), first + s * per);
      Put32(datagram.data() + 8, static_cast<uint32_t>(count));
      Put32(datagram.data() + 12, contributors == nullptr ? 1u : (*contributors)[s]);
      Put64(datagram.data() + 16, options.announcement);
      for (size_t i = 0; i < count; ++i)
        put_value(datagram.data() + kHeaderBytes + value_bytes * i, values[s * per + i]);
      const size_t bytes = kHeaderBytes + value_bytes * count;
      absl::Status sent = transport.Send(peer, tag, absl::MakeConstSpan(datagram.data(), bytes));
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

  // 1. Reduce-scatter: my values of every other chunk to its owner.
  const absl::Time start = absl::Now();
  for (int k = 1; k < n; ++k) {
    const int c = (me + k) % n;  // each rank starts with a different owner
    if (absl::Status s = send_slices(c, tag0, chunks.Begin(c),
                                     input.subspan(chunks.Begin(c), chunks.End(c) - chunks.Begin(c)), nullptr);
        !s.ok()) {
      return s;
    }
  }
  const size_t my_begin = chunks.Begin(me), my_end = chunks.End(me);
  const size_t my_slices = chunks.Slices(me, per);
  std::vector<double> sum(my_end - my_begin);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = round_trip(input[my_begin + i]);
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

  // 2. The owner's means, to every rank, once the first phase ends.
  bool reduced = false;
  auto finish_reduce = [&]() -> absl::Status {
    reduced = true;
    for (size_t i = 0; i < sum.size(); ++i) {
      const double by = options.normalize ? count[i / per] : n;
      output[my_begin + i] = round_trip(static_cast<float>(sum[i] / by));
    }
    const absl::Span<const float> means = output.subspan(my_begin, my_end - my_begin);
    paced_from = absl::Now();
    paced_bytes = 0;
    for (int k = 1; k < n; ++k) {
      if (absl::Status s = send_slices((me + k) % n, tag1, my_begin, means, &count); !s.ok()) return s;
    }
    return absl::OkStatus();
  };

  const absl::Time reduce_deadline = start + options.phase_timeout;
  const absl::Time end_deadline = reduce_deadline + options.phase_timeout;
  while (true) {
    const absl::Time now = absl::Now();
    if (!reduced && (result.contributions_arrived == result.contributions_expected || now >= reduce_deadline)) {
      if (absl::Status s = finish_reduce(); !s.ok()) return s;
    }
    if (reduced && (result.gathered_arrived == result.gathered_expected || now >= end_deadline)) break;
    absl::StatusOr<ReceivedDatagram> got =
        transport.Receive(absl::MakeSpan(datagram), reduced ? end_deadline : reduce_deadline);
    if (absl::IsDeadlineExceeded(got.status())) continue;
    if (!got.ok()) return got.status();
    Slice s;
    if (got->bytes < kHeaderBytes) {
      ++result.rejected;
      continue;
    }
    s.first = Get64(datagram.data());
    s.count = Get32(datagram.data() + 8);
    s.contributors = Get32(datagram.data() + 12);
    s.values = datagram.data() + kHeaderBytes;
    if (s.count == 0 || s.count > per || got->bytes != kHeaderBytes + value_bytes * static_cast<size_t>(s.count) ||
        s.contributors == 0 || s.contributors > static_cast<uint32_t>(n) || got->source < 0 || got->source >= n ||
        got->source == me) {
      ++result.rejected;
      continue;
    }
    // Parsed and of this call: whatever becomes of its values, its sender was heard.
    if (!heard[got->source]) {
      heard[got->source] = true;
      ++result.ranks_heard;
    }
    result.highest_announcement = std::max(result.highest_announcement, Get64(datagram.data() + 16));
    if (got->tag == tag0) {
      const int64_t slice = SliceIndex(s, my_begin, my_end, per);
      if (slice < 0 || s.contributors != 1 || counted[got->source][slice]) {
        ++result.rejected;
        continue;
      }
      counted[got->source][slice] = true;
      if (reduced) {  // late: the means have gone out without it
        ++result.late;
        continue;
      }
      ++result.contributions_arrived;
      ++result.arrived_from[got->source];
      ++count[slice];
      for (uint32_t i = 0; i < s.count; ++i) sum[s.first - my_begin + i] += get_value(s.values + value_bytes * i);
    } else {
      const int owner = got->source;
      const int64_t slice = SliceIndex(s, chunks.Begin(owner), chunks.End(owner), per);
      if (slice < 0 || gathered[owner][slice]) {
        ++result.rejected;
        continue;
      }
      gathered[owner][slice] = true;
      ++result.gathered_arrived;
      ++result.arrived_from[owner];
      for (uint32_t i = 0; i < s.count; ++i) output[s.first + i] = get_value(s.values + value_bytes * i);
    }
  }
  for (int c = 0; c < n; ++c) {
    if (c == me) continue;
    for (size_t slice = 0; slice < gathered[c].size(); ++slice) {
      if (!gathered[c][slice]) result.kept_own_elements += std::min(per, chunks.End(c) - chunks.Begin(c) - slice * per);
    }
  }
  return result;
}

}  // namespace dynamiq::engine
