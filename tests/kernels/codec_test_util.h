// Helpers shared by the codec tests (tests/kernels/*_codec_test.cc): sources and destinations over
// vectors, Gaussian data, compress / DAR / decompress that expect success, and the check of a chunk
// a codec must refuse.
#ifndef DQ_TESTS_KERNELS_CODEC_TEST_UTIL_H_
#define DQ_TESTS_KERNELS_CODEC_TEST_UTIL_H_

#include <stdint.h>

#include <functional>
#include <random>
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

inline Source Src(const std::vector<float>& v, size_t first = 0) {
  Source s;
  s.data = v.data();
  s.first = first;
  return s;
}

inline Dest Dst(std::vector<float>& v, size_t first = 0) {
  Dest d;
  d.data = v.data();
  d.first = first;
  return d;
}

inline std::vector<uint8_t> MustCompress(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                                         const Source& src) {
  std::vector<uint8_t> out(codec.MaxEncodedBytes(plan, chunk));
  auto n = codec.Compress(plan, chunk, src, absl::MakeSpan(out));
  EXPECT_TRUE(n.ok()) << n.status();
  if (n.ok()) out.resize(*n);
  return out;
}

inline std::vector<uint8_t> MustDar(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                                    const std::vector<uint8_t>& in, const Source& src) {
  std::vector<uint8_t> out(codec.MaxEncodedBytes(plan, chunk));
  auto n = codec.DecompressAccumulateRecompress(plan, chunk, in, src, absl::MakeSpan(out));
  EXPECT_TRUE(n.ok()) << n.status();
  if (n.ok()) out.resize(*n);
  return out;
}

inline std::vector<float> MustDecompress(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                                         const std::vector<uint8_t>& in) {
  std::vector<float> out(chunk.count, -12345.0f);
  DQ_EXPECT_OK(codec.Decompress(plan, chunk, in, Dst(out, chunk.begin)));
  return out;
}

inline std::vector<float> Gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Decompress, DecompressAccumulate and DecompressAccumulateRecompress (adding `local`) of `bytes`
// as `chunk` of `plan`: each must fail with `code` and a message containing `substr`, and leave
// its output untouched.
inline void ExpectChunkRejected(const Codec& codec, const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                const std::vector<uint8_t>& bytes, absl::StatusCode code, const std::string& substr) {
  using ::dynamiq::testing::StatusIs;
  using ::testing::HasSubstr;
  std::vector<float> out(chunk.count, 42.0f);
  EXPECT_THAT(codec.Decompress(plan, chunk, bytes, Dst(out, chunk.begin)), StatusIs(code, HasSubstr(substr)));
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

#endif  // DQ_TESTS_KERNELS_CODEC_TEST_UTIL_H_
