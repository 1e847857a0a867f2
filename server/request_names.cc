#include "server/request_names.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace dynamiq::server {
namespace {

// The byte offset of the first invalid UTF-8 sequence (RFC 3629: no overlongs, no surrogates,
// nothing above U+10FFFF), or npos.
size_t FirstInvalidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    size_t len;
    uint32_t min, cp;
    if (b < 0x80) {
      ++i;
      continue;
    } else if ((b & 0xe0) == 0xc0) {
      len = 2, min = 0x80, cp = b & 0x1f;
    } else if ((b & 0xf0) == 0xe0) {
      len = 3, min = 0x800, cp = b & 0x0f;
    } else if ((b & 0xf8) == 0xf0) {
      len = 4, min = 0x10000, cp = b & 0x07;
    } else {
      return i;
    }
    if (s.size() - i < len) return i;
    for (size_t k = 1; k < len; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xc0) != 0x80) return i;
      cp = (cp << 6) | (c & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
    i += len;
  }
  return absl::string_view::npos;
}

}  // namespace

absl::Status CheckRequestName(absl::string_view what, absl::string_view value, size_t max_bytes, bool allow_empty) {
  if (value.empty()) {
    if (allow_empty) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  }
  if (value.size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", QuoteName(value), " is longer than ", max_bytes, " bytes"));
  }
  if (const size_t bad = FirstInvalidUtf8(value); bad != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", QuoteName(value), " is not valid UTF-8 (at byte ", bad, ")"));
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
