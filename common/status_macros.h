// Status propagation helpers shared by every module.
//
// abseil 20220623 (Debian 12) ships absl::Status but not absl/status/status_macros.h, so we
// define our own with DQ_ names; switching to ABSL_RETURN_IF_ERROR later is a rename.
#ifndef DQ_COMMON_STATUS_MACROS_H_
#define DQ_COMMON_STATUS_MACROS_H_

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define DQ_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status dq_status_ = (expr);      \
    if (!dq_status_.ok()) return dq_status_; \
  } while (0)

#define DQ_STATUS_MACROS_CONCAT_INNER_(a, b) a##b
#define DQ_STATUS_MACROS_CONCAT_(a, b) DQ_STATUS_MACROS_CONCAT_INNER_(a, b)

// `DQ_ASSIGN_OR_RETURN(auto x, Foo());` assigns the value of an absl::StatusOr or returns its
// error from the enclosing function. It expands to several statements: brace it inside an `if`.
#define DQ_ASSIGN_OR_RETURN(lhs, expr) \
  DQ_ASSIGN_OR_RETURN_IMPL_(DQ_STATUS_MACROS_CONCAT_(dq_statusor_, __LINE__), lhs, expr)
#define DQ_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)     \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

// Invariant check: a failure is a bug in dynamiq, never bad input, so it aborts with file:line.
// Bad input from workers, operators or peers must be reported with an absl::Status instead.
#define DQ_CHECK(cond)                                                                 \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: DQ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

namespace dynamiq::common {

// `status` with "<prefix>: " put before its message, keeping its code and its payloads (which typed
// errors such as engine::IsDifferentCollective read, so no caller parses message text). OK stays OK.
inline absl::Status Annotate(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  absl::Status annotated(status.code(), absl::StrCat(prefix, ": ", status.message()));
  status.ForEachPayload(
      [&annotated](absl::string_view type_url, const absl::Cord& payload) { annotated.SetPayload(type_url, payload); });
  return annotated;
}

// `status` with its message replaced by `message` (which usually quotes the old one), keeping its
// code and payloads, where a prefix (Annotate) does not say it. OK stays OK.
inline absl::Status Restate(const absl::Status& status, absl::string_view message) {
  if (status.ok()) return status;
  absl::Status restated(status.code(), message);
  status.ForEachPayload(
      [&restated](absl::string_view type_url, const absl::Cord& payload) { restated.SetPayload(type_url, payload); });
  return restated;
}

}  // namespace dynamiq::common

#endif  // DQ_COMMON_STATUS_MACROS_H_
