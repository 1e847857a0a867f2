// DQ_NCCL_RETURN_IF_ERROR: the checker for NCCL calls (one checker per error source, as NCCL's own
// NCCLCHECK), turning a failed call into an absl::Status with the call, file:line,
// ncclGetErrorString and ncclGetLastError's text.
//
// Only for the NCCL transport (engine/nccl_transport.cc), which is built when nccl.h and libnccl
// are both found. Header-only; the caller links libnccl.
#ifndef DQ_ENGINE_NCCL_CHECK_H_
#define DQ_ENGINE_NCCL_CHECK_H_

#include <nccl.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dynamiq::engine {

// The status for `result` returned by `what` (an expression or a description) at file:line.
//   - ncclSystemError, ncclRemoteError (sockets, a peer that died or failed): UNAVAILABLE; the
//     owner re-forms the group.
//   - Anything else (invalid argument or usage, unhandled CUDA error, internal error, and
//     ncclInProgress where it was not expected): INTERNAL.
// `comm` (may be null) is passed to ncclGetLastError, whose text can stem from an earlier
// asynchronous operation (NCCL documents this); it is appended when not empty.
inline absl::Status NcclErrorStatus(ncclResult_t result, ncclComm_t comm, const char* what, const char* file,
                                    int line) {
  std::string message = absl::StrCat(file, ":", line, ": ", what, " failed: ", ncclGetErrorString(result));
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&message, " (", last, ")");
  if (result == ncclSystemError || result == ncclRemoteError) return absl::UnavailableError(std::move(message));
  return absl::InternalError(std::move(message));
}

}  // namespace dynamiq::engine

// Returns from the enclosing function (which returns absl::Status or absl::StatusOr<T>) if `expr`,
// an NCCL call, does not return ncclSuccess. Calls on a non-blocking communicator that may return
// ncclInProgress must be checked by hand.
#define DQ_NCCL_RETURN_IF_ERROR(expr)                                                                 \
  do {                                                                                                \
    const ncclResult_t dq_nccl_result_ = (expr);                                                      \
    if (dq_nccl_result_ != ncclSuccess) {                                                             \
      return ::dynamiq::engine::NcclErrorStatus(dq_nccl_result_, nullptr, #expr, __FILE__, __LINE__); \
    }                                                                                                 \
  } while (0)

#endif  // DQ_ENGINE_NCCL_CHECK_H_
