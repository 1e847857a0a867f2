// Timeline: what one rank spent its time on during a collective (codec work, checksums, waiting
// for the network), as spans on the wall clock, so that the ranks' timelines of one host line up.
// For finding where the time goes (dynamiq-bench allreduce --timeline_out, scripts/bench-network
// --timeline, docs/design.md "Where the time goes"), not for production: the engine records only
// when AllReduceOptions::timeline is set (otherwise one branch per span).
//
// Not thread-safe: one timeline per collective at a time.
#ifndef DQ_ENGINE_TIMELINE_H_
#define DQ_ENGINE_TIMELINE_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/time/clock.h"

namespace dynamiq::engine {

class Timeline {
 public:
  enum class Kind : uint8_t {
    kStats,        // computing the codec's statistics
    kWaitStats,    // waiting for the other ranks' statistics sums
    kPlan,         // planning a block (bit allocation, centring)
    kCompress,     // a block's first message of a chunk
    kDar,          // decoding, accumulating and re-encoding a received partial sum
    kDecompress,   // decoding a final chunk into the output
    kChecksum,     // payload checksums or MACs, both sides
    kWaitHeader,   // waiting for a message's header
    kWaitPayload,  // waiting for a message's payload
    kWaitSent,     // waiting for a sent message to leave (before its buffer is reused)
  };
  static constexpr int kNumKinds = 10;
  static const char* Name(Kind kind);

  struct Span {
    Kind kind;
    uint32_t block;
    int64_t begin_ns, end_ns;  // absl::GetCurrentTimeNanos()
  };

  void Add(Kind kind, uint32_t block, int64_t begin_ns, int64_t end_ns) {
    spans_.push_back(Span{kind, block, begin_ns, end_ns});
  }
  void Clear() { spans_.clear(); }
  const std::vector<Span>& spans() const { return spans_; }

  // Nanoseconds per kind, summed over the spans.
  std::vector<int64_t> Totals() const;

  // The spans as Chrome trace events ("traceEvents", complete events in microseconds), process
  // `pid` (the rank): chrome://tracing and Perfetto open the ranks' files together.
  std::string ToChromeTrace(int pid) const;

 private:
  std::vector<Span> spans_;
};

// Records the span from its construction to its destruction on `timeline` (nothing when null).
class TimelineSpan {
 public:
  TimelineSpan(Timeline* timeline, Timeline::Kind kind, uint32_t block = 0)
      : timeline_(timeline),
        kind_(kind),
        block_(block),
        begin_(timeline != nullptr ? absl::GetCurrentTimeNanos() : 0) {}
  ~TimelineSpan() {
    if (timeline_ != nullptr) timeline_->Add(kind_, block_, begin_, absl::GetCurrentTimeNanos());
  }
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  Timeline* timeline_;
  Timeline::Kind kind_;
  uint32_t block_;
  int64_t begin_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_TIMELINE_H_
