// The codec table (kernels/codec_info.h): one row per codec id, names that parse back, bit
// settings that the registry and the daemon honour.
#include "kernels/codec_info.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(CodecInfoTest, EveryIdHasARowWhoseNameParsesBack) {
  ASSERT_EQ(AllCodecs().size(), static_cast<size_t>(kNumCodecs));
  for (int i = 0; i < kNumCodecs; ++i) {
    const CodecId id = static_cast<CodecId>(i);
    const CodecInfo& info = GetCodecInfo(id);
    EXPECT_EQ(info.id, id);
    absl::StatusOr<CodecId> parsed = ParseCodecId(info.name);
    ASSERT_THAT(parsed, IsOk());
    EXPECT_EQ(*parsed, id);
  }
  EXPECT_THAT(ParseCodecId("zstd"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("none, bf16, dynamiq")));
}

TEST(CodecInfoTest, DefaultBitsAreValidAndEveryCodecBuildsWithThem) {
  for (const CodecInfo& info : AllCodecs()) {
    CodecConfig config;
    config.id = info.id;
    config.bits = info.default_bits;
    EXPECT_THAT(CheckCodecBits(info.id, info.default_bits), IsOk()) << info.name;
    EXPECT_THAT(CreateCodec(config), IsOk()) << info.name;
    if (info.has_bits) {
      EXPECT_LE(info.min_bits, info.default_bits);
      EXPECT_GE(info.max_bits, info.default_bits);
      EXPECT_THAT(CheckCodecBits(info.id, info.max_bits + 1), StatusIs(absl::StatusCode::kInvalidArgument));
      EXPECT_THAT(CheckCodecBits(info.id, info.min_bits - 0.5), StatusIs(absl::StatusCode::kInvalidArgument));
    } else {
      EXPECT_EQ(info.default_bits, 0) << info.name;
    }
  }
}

TEST(CodecInfoTest, MessagesNameTheRange) {
  EXPECT_THAT(CheckCodecBits(CodecId::kDynamiq, 9),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dynamiq bits must be between 3 and 8 (average incl. metadata), got 9")));
  EXPECT_THAT(CheckCodecBits(CodecId::kUniform, 3.5),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("uniform bits must be an integer 2..8")));
  EXPECT_THAT(CheckCodecBits(CodecId::kThc, 5),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("thc uses 4-bit codes, got bits 5")));
  EXPECT_THAT(CheckCodecBits(CodecId::kMxfp8, -1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not use it")));
}

TEST(CodecInfoTest, GpuCodecsAreListedFromTheTable) {
  EXPECT_EQ(CudaCodecNames(), "none, bf16 and dynamiq");
  EXPECT_TRUE(GetCodecInfo(CodecId::kDynamiq).on_cuda);
  EXPECT_FALSE(GetCodecInfo(CodecId::kMxfp8).on_cuda);
}

}  // namespace
}  // namespace dynamiq::kernels
