#include "server/request_names.h"

#include <google/protobuf/stubs/common.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace dynamiq::server {

absl::Status CheckRequestName(absl::string_view what, absl::string_view value, size_t max_bytes, bool allow_empty) {
  if (value.empty()) {
    if (allow_empty) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  }
  if (value.size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", QuoteName(value), " is longer than ", max_bytes, " bytes"));
  }
  // protobuf's own test: what it accepts in the `string` fields the name is echoed into.
  if (!google::protobuf::internal::IsStructurallyValidUTF8(value.data(), static_cast<int>(value.size()))) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", QuoteName(value), " is not valid UTF-8"));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    const auto c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", QuoteName(value), " contains a control character (byte ", i, ")"));
    }
  }
  return absl::OkStatus();
}

std::string QuoteName(absl::string_view value, size_t max_bytes) {
  if (value.size() <= max_bytes) return absl::StrCat("'", absl::CHexEscape(value), "'");
  return absl::StrCat("'", absl::CHexEscape(value.substr(0, max_bytes)), "'... (", value.size(), " bytes)");
}

absl::StatusOr<uint64_t> ParseWorkerId(absl::string_view id) {
  uint64_t v = 0;
  const bool digits = !id.empty() && id.size() <= 20 &&
                      std::all_of(id.begin(), id.end(), [](char c) { return absl::ascii_isdigit(c); });
  if (!digits || !absl::SimpleAtoi(id, &v) || v == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed worker id ", QuoteName(id), ": use the decimal id Register returned"));
  }
  return v;
}

}  // namespace dynamiq::server
