#include "common/safe_text.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace dynamiq::common {
namespace {

// The length of the well-formed UTF-8 sequence at the start of `s` and its code point, or 0 when
// the bytes there are not one (RFC 3629: no overlong forms, no surrogates, at most U+10FFFF).
size_t DecodeOne(absl::string_view s, uint32_t* code_point) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = byte(0);
  if (b0 < 0x80) {
    *code_point = b0;
    return 1;
  }
  size_t n;
  uint32_t cp;
  uint32_t min;
  if ((b0 & 0xe0) == 0xc0) {
    n = 2, cp = b0 & 0x1f, min = 0x80;
  } else if ((b0 & 0xf0) == 0xe0) {
    n = 3, cp = b0 & 0x0f, min = 0x800;
  } else if ((b0 & 0xf8) == 0xf0) {
    n = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (s.size() < n) return 0;
  for (size_t i = 1; i < n; ++i) {
    if ((byte(i) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i) & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  *code_point = cp;
  return n;
}

bool IsControl(uint32_t cp) { return cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp <= 0x9f); }

}  // namespace

std::string SafeText(absl::string_view text, size_t max_bytes) {
  std::string out;
  const bool cut = text.size() > max_bytes;
  const size_t end = std::min(text.size(), max_bytes);
  out.reserve(end);
  size_t i = 0;
  while (i < end) {
    uint32_t cp = 0;
    const size_t n = DecodeOne(text.substr(i), &cp);
    if (i + n > end) break;  // a sequence the cut would split: dropped whole
    if (n == 0 || IsControl(cp)) {
      // Escaped byte by byte (a C1 control has two).
      for (size_t k = 0; k < std::max<size_t>(n, 1); ++k) {
        absl::StrAppendFormat(&out, "\\x%02x", static_cast<uint8_t>(text[i + k]));
      }
      i += std::max<size_t>(n, 1);
      continue;
    }
    out.append(text.data() + i, n);
    i += n;
  }
  if (cut) out += "...";
  return out;
}

bool IsValidUtf8(absl::string_view text) {
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    const size_t n = DecodeOne(text.substr(i), &cp);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

}  // namespace dynamiq::common
