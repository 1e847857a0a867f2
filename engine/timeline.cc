#include "engine/timeline.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dynamiq::engine {

const char* Timeline::Name(Kind kind) {
  switch (kind) {
    case Kind::kStats:
      return "stats";
    case Kind::kWaitStats:
      return "wait_stats";
    case Kind::kPlan:
      return "plan";
    case Kind::kCompress:
      return "compress";
    case Kind::kDar:
      return "dar";
    case Kind::kDecompress:
      return "decompress";
    case Kind::kChecksum:
      return "checksum";
    case Kind::kWaitHeader:
      return "wait_header";
    case Kind::kWaitPayload:
      return "wait_payload";
    case Kind::kWaitSent:
      return "wait_sent";
  }
  return "?";
}

std::vector<int64_t> Timeline::Totals() const {
  std::vector<int64_t> totals(kNumKinds, 0);
  for (const Span& s : spans_) totals[static_cast<int>(s.kind)] += s.end_ns - s.begin_ns;
  return totals;
}

std::string Timeline::ToChromeTrace(int pid) const {
  std::vector<std::string> events;
  events.reserve(spans_.size());
  for (const Span& s : spans_) {
    events.push_back(absl::StrCat(R"({"name":")", Name(s.kind), R"(","ph":"X","pid":)", pid, R"(,"tid":0,"ts":)",
                                  s.begin_ns / 1000, ".", s.begin_ns / 100 % 10, R"(,"dur":)",
                                  (s.end_ns - s.begin_ns) / 1000, ".", (s.end_ns - s.begin_ns) / 100 % 10,
                                  R"(,"args":{"block":)", s.block, "}}"));
  }
  return absl::StrCat(R"({"traceEvents":[)", absl::StrJoin(events, ",\n"), "]}\n");
}

}  // namespace dynamiq::engine
