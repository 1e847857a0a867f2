// FlagNamesWithUnderscores: the command-line words of dynamiqd and dynamiqctl with every flag name
// spelled with underscores, so that either spelling works (--metrics-port is --metrics_port).
// Values and the words after "--" are left alone. Header-only; a pure function.
#ifndef DQ_COMMON_FLAG_NAMES_H_
#define DQ_COMMON_FLAG_NAMES_H_

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "absl/strings/match.h"

namespace dynamiq::common {

// argv[0..argc) with the names of "--name[=value]" words converted.
inline std::vector<std::string> FlagNamesWithUnderscores(int argc, char** argv) {
  std::vector<std::string> words(argv, argv + argc);
  for (int i = 1; i < argc && words[i] != "--"; ++i) {
    std::string& word = words[i];
    if (!absl::StartsWith(word, "--")) continue;
    const size_t end = std::min(word.find('='), word.size());
    std::replace(word.begin() + 2, word.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
  }
  return words;
}

}  // namespace dynamiq::common

#endif  // DQ_COMMON_FLAG_NAMES_H_
