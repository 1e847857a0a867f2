#include "engine/step_header.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/little_endian.h"
#include "engine/schedule.h"
#include "kernels/codec.h"

namespace dynamiq::engine {
namespace {

constexpr uint32_t kMagic = 0x31535144u;  // "DQS1"
constexpr uint8_t kVersion = 2;
constexpr uint8_t kFlagAuthenticated = 1;
constexpr uint8_t kScheduleShift = 1;
constexpr uint8_t kScheduleMask = 0x7 << kScheduleShift;
// Marks a MatchStepHeader error whose collective ids differ (IsDifferentCollective).
constexpr char kDifferentCollectivePayload[] = "type.dynamiq.dev/engine.DifferentCollective";

absl::string_view PhaseName(Phase p) {
  switch (p) {
    case Phase::kStats:
      return "statistics";
    case Phase::kReduceScatter:
      return "reduce-scatter";
    case Phase::kAllGather:
      return "all-gather";
    case Phase::kSideLane:
      return "side lane";
  }
  return "?";
}

}  // namespace

std::array<uint8_t, kStepHeaderBytes> EncodeStepHeader(const StepHeader& h) {
  std::array<uint8_t, kStepHeaderBytes> b{};
  common::PutLe<uint32_t>(&b[0], kMagic);
  b[4] = kVersion;
  b[5] = static_cast<uint8_t>(h.phase);
  b[6] = h.codec;
  b[7] = static_cast<uint8_t>((h.authenticated ? kFlagAuthenticated : 0) |
                              ((h.schedule << kScheduleShift) & kScheduleMask));
  common::PutLe<uint32_t>(&b[8], h.bits_x1000);
  common::PutLe<uint32_t>(&b[12], h.sender);
  common::PutLe<uint64_t>(&b[16], h.job_id);
  common::PutLe<uint64_t>(&b[24], h.config_epoch);
  common::PutLe<uint64_t>(&b[32], h.sequence);
  common::PutLe<uint32_t>(&b[40], h.step);
  common::PutLe<uint32_t>(&b[44], h.block);
  common::PutLe<uint32_t>(&b[48], h.payload_bytes);
  if (h.authenticated) {
    std::memcpy(&b[kStepHeaderMacCoverage], h.tag.data(), kStepTagBytes);
  } else {
    common::PutLe<uint64_t>(&b[56], h.checksum);
  }
  return b;
}

absl::StatusOr<StepHeader> DecodeStepHeader(absl::Span<const uint8_t> b) {
  if (b.size() != kStepHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("step header of ", b.size(), " bytes, expected ", kStepHeaderBytes));
  }
  if (common::GetLe<uint32_t>(&b[0]) != kMagic)
    return absl::InvalidArgumentError("not a dynamiq step header (bad magic)");
  if (b[4] != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("step header version ", b[4], ", this build speaks ", kVersion));
  }
  if (b[5] > 3) return absl::InvalidArgumentError(absl::StrCat("step header with unknown phase ", b[5]));
  if ((b[7] & ~(kFlagAuthenticated | kScheduleMask)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("step header with unknown flags ", b[7]));
  }
  const bool authenticated = (b[7] & kFlagAuthenticated) != 0;
  if (!authenticated && common::GetLe<uint32_t>(&b[52]) != 0)
    return absl::InvalidArgumentError("step header reserved bytes set");
  StepHeader h;
  h.authenticated = authenticated;
  h.phase = static_cast<Phase>(b[5]);
  h.codec = b[6];
  h.schedule = static_cast<uint8_t>((b[7] & kScheduleMask) >> kScheduleShift);
  h.bits_x1000 = common::GetLe<uint32_t>(&b[8]);
  h.sender = common::GetLe<uint32_t>(&b[12]);
  h.job_id = common::GetLe<uint64_t>(&b[16]);
  h.config_epoch = common::GetLe<uint64_t>(&b[24]);
  h.sequence = common::GetLe<uint64_t>(&b[32]);
  h.step = common::GetLe<uint32_t>(&b[40]);
  h.block = common::GetLe<uint32_t>(&b[44]);
  h.payload_bytes = common::GetLe<uint32_t>(&b[48]);
  if (authenticated) {
    std::memcpy(h.tag.data(), &b[kStepHeaderMacCoverage], kStepTagBytes);
  } else {
    h.checksum = common::GetLe<uint64_t>(&b[56]);
  }
  return h;
}

absl::Status MatchStepHeader(const StepHeader& r, const StepHeader& e) {
  std::vector<std::string> diffs;
  auto check = [&](absl::string_view field, const std::string& got, const std::string& want) {
    if (got != want) diffs.push_back(absl::StrCat(field, " ", got, " (expected ", want, ")"));
  };
  check("sender", absl::StrCat(r.sender), absl::StrCat(e.sender));
  check("job", absl::StrCat(r.job_id), absl::StrCat(e.job_id));
  check("config epoch", absl::StrCat(r.config_epoch), absl::StrCat(e.config_epoch));
  check("collective", absl::StrCat(r.sequence), absl::StrCat(e.sequence));
  check("phase", std::string(PhaseName(r.phase)), std::string(PhaseName(e.phase)));
  check("step", absl::StrCat(r.step), absl::StrCat(e.step));
  check("block", absl::StrCat(r.block), absl::StrCat(e.block));
  check("codec", std::string(kernels::CodecName(static_cast<kernels::CodecId>(r.codec))),
        std::string(kernels::CodecName(static_cast<kernels::CodecId>(e.codec))));
  check("bits", absl::StrCat(r.bits_x1000 / 1000.0), absl::StrCat(e.bits_x1000 / 1000.0));
  auto schedule = [](uint8_t id) -> std::string {
    for (Topology t : {Topology::kRing, Topology::kButterfly, Topology::kTwoShot}) {
      if (id == ScheduleId(t)) return std::string(TopologyName(t));
    }
    return absl::StrCat("schedule ", id);
  };
  check("schedule", schedule(r.schedule), schedule(e.schedule));
  if (diffs.empty()) return absl::OkStatus();
  absl::Status mismatch = absl::FailedPreconditionError(
      absl::StrCat("rank ", r.sender, " runs a different collective: ", absl::StrJoin(diffs, ", ")));
  if (r.job_id != e.job_id) mismatch.SetPayload(kDifferentCollectivePayload, absl::Cord());
  return mismatch;
}

bool IsDifferentCollective(const absl::Status& status) {
  return status.GetPayload(kDifferentCollectivePayload).has_value();
}

}  // namespace dynamiq::engine
