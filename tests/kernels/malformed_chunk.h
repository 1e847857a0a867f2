// Shared check of the codec tests' malformed-input fixtures: a chunk a codec must refuse.
#ifndef DQ_TESTS_KERNELS_MALFORMED_CHUNK_H_
#define DQ_TESTS_KERNELS_MALFORMED_CHUNK_H_

#include <stdint.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/wire_format.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels::testing {

// Decompress, DecompressAccumulate and DecompressAccumulateRecompress (adding `local`) of `bytes`
// as `chunk` of `plan`: each must fail with `code` and a message containing `substr`, and leave
// its output untouched.
inline void ExpectChunkRejected(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                const std::vector<uint8_t>& bytes, absl::StatusCode code, const std::string& substr) {
  using ::dynamiq::testing::StatusIs;
  using ::testing::HasSubstr;
  std::vector<float> out(chunk.count, 42.0f);
  Dest dest;
  dest.data = out.data();
  dest.first = chunk.begin;
  EXPECT_THAT(codec.Decompress(plan, chunk, bytes, dest), StatusIs(code, HasSubstr(substr)));
  EXPECT_THAT(out, ::testing::Each(42.0f));
  EXPECT_THAT(codec.DecompressAccumulate(plan, chunk, bytes, out.data()), StatusIs(code, HasSubstr(substr)));
  EXPECT_THAT(out, ::testing::Each(42.0f));
  std::vector<uint8_t> dar(codec.MaxEncodedBytes(plan, chunk), 0x5a);
  EXPECT_THAT(codec.DecompressAccumulateRecompress(plan, chunk, bytes, local, absl::MakeSpan(dar)),
              StatusIs(code, HasSubstr(substr)));
  EXPECT_THAT(dar, ::testing::Each(0x5a));
}

// `bytes` with its chunk header changed by `edit` (the header must parse).
inline std::vector<uint8_t> WithChunkHeader(std::vector<uint8_t> bytes, const std::function<void(ChunkHeader&)>& edit) {
  ChunkHeader h = *ParseChunkHeader(bytes);
  edit(h);
  WriteChunkHeader(h, absl::MakeSpan(bytes));
  return bytes;
}

}  // namespace dynamiq::kernels::testing

#endif  // DQ_TESTS_KERNELS_MALFORMED_CHUNK_H_
