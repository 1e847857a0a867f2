// SafeText: text that came from elsewhere (a peer's "gave up" reason, an error message carrying a
// peer's words) made fit to log, return to a worker and store in a protobuf `string` field.
//
// The result is valid UTF-8 without control characters: printable ASCII and well-formed UTF-8
// sequences of printable code points stay as they are; C0 controls (CR, LF, ESC, NUL, ...), DEL,
// C1 controls (U+0080..U+009F) and every byte that is not part of a well-formed sequence (stray
// continuation bytes, overlong forms, surrogates, code points past U+10FFFF, truncated sequences)
// become "\xNN", one per byte. So a line can neither be split, nor recoloured, nor forged, and
// protobuf's UTF-8 check on `string` fields always passes. At most `max_bytes` of the input are
// read (never cutting a sequence in half); a longer input ends in "...".
#ifndef DQ_COMMON_SAFE_TEXT_H_
#define DQ_COMMON_SAFE_TEXT_H_

#include <stddef.h>

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace dynamiq::common {

std::string SafeText(absl::string_view text, size_t max_bytes = SIZE_MAX);

// Whether `text` is valid UTF-8 (any code points, controls included).
bool IsValidUtf8(absl::string_view text);

}  // namespace dynamiq::common

#endif  // DQ_COMMON_SAFE_TEXT_H_
