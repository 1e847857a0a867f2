#include "server/job_observer.h"

namespace dynamiq::server {

absl::string_view CollectiveResultName(CollectiveResult result) {
  switch (result) {
    case CollectiveResult::kOk:
      return "ok";
    case CollectiveResult::kError:
      return "error";
    case CollectiveResult::kTimeout:
      return "timeout";
    case CollectiveResult::kAborted:
      return "aborted";
  }
  return "error";
}

absl::string_view FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kNone:
      return "none";
    case FaultKind::kTimeout:
      return "timeout";
    case FaultKind::kAbort:
      return "abort";
    case FaultKind::kPeerFailure:
      return "peer_failure";
    case FaultKind::kMismatch:
      return "mismatch";
  }
  return "peer_failure";
}

Classification ClassifyFailure(const absl::Status& status, bool stopping) {
  if (status.ok()) return {CollectiveResult::kOk, FaultKind::kNone};
  if (stopping) return {CollectiveResult::kAborted, FaultKind::kAbort};
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return {CollectiveResult::kTimeout, FaultKind::kTimeout};
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
      return {CollectiveResult::kAborted, FaultKind::kAbort};
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
      return {CollectiveResult::kError, FaultKind::kMismatch};
    default:
      return {CollectiveResult::kError, FaultKind::kPeerFailure};
  }
}

uint64_t BusBytes(uint64_t payload_bytes, uint32_t num_nodes) {
  if (num_nodes <= 1) return 0;
  // 128-bit intermediate: payload x 2(n-1) may exceed 64 bits for absurd sizes.
  const unsigned __int128 bus = static_cast<unsigned __int128>(payload_bytes) * 2 * (num_nodes - 1) / num_nodes;
  return static_cast<uint64_t>(bus);
}

}  // namespace dynamiq::server
