#include "kernels/cpu/simple_codecs.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/bf16_math.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {
namespace {

// Works in tiles so no chunk-sized temporary is ever allocated.
constexpr size_t kTile = 1024;

class SimpleCodec final : public Codec {
 public:
  explicit SimpleCodec(const CodecConfig& config) : Codec(config), bytes_(config.id == CodecId::kNone ? 4 : 2) {}

  std::string Describe() const override {
    return bytes_ == 4 ? "none: fp32, lossless, 32 bits/coord + 32 B header per chunk"
                       : "bf16: round to nearest even at every hop, 16 bits/coord + 32 B header per chunk";
  }

  size_t MaxEncodedBytes(const BucketPlan&, const ChunkRef& chunk) const override {
    return kChunkHeaderBytes + bytes_ * chunk.count;
  }

  absl::StatusOr<size_t> Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                  absl::Span<uint8_t> out) const override {
    return Encode(plan, chunk, 1, out, [&](size_t begin, size_t n, float* tile) { LoadSource(local, begin, n, tile); });
  }

  absl::Status Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                          const Dest& out) const override {
    DQ_ASSIGN_OR_RETURN(ChunkHeader h, Check(plan, chunk, in));
    (void)h;
    float tile[kTile];
    for (size_t i = 0; i < chunk.count; i += kTile) {
      const size_t n = std::min(kTile, chunk.count - i);
      DecodeTile(in, i, n, tile);
      StoreDest(out, chunk.begin + i, n, tile);
    }
    return absl::OkStatus();
  }

  absl::Status DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                    float* acc) const override {
    DQ_ASSIGN_OR_RETURN(ChunkHeader h, Check(plan, chunk, in));
    (void)h;
    float tile[kTile];
    for (size_t i = 0; i < chunk.count; i += kTile) {
      const size_t n = std::min(kTile, chunk.count - i);
      DecodeTile(in, i, n, tile);
      for (size_t k = 0; k < n; ++k) acc[i + k] += tile[k];
    }
    return absl::OkStatus();
  }

  absl::StatusOr<size_t> DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                        absl::Span<const uint8_t> in, const Source& local,
                                                        absl::Span<uint8_t> out) const override {
    DQ_ASSIGN_OR_RETURN(ChunkHeader h, Check(plan, chunk, in));
    const uint16_t summands = h.num_summands == 0xffff ? h.num_summands : h.num_summands + 1;
    return Encode(plan, chunk, summands, out, [&](size_t begin, size_t n, float* tile) {
      float received[kTile];
      LoadSource(local, begin, n, tile);
      DecodeTile(in, begin - chunk.begin, n, received);
      for (size_t k = 0; k < n; ++k) tile[k] = received[k] + tile[k];
    });
  }

 private:
  absl::StatusOr<ChunkHeader> Check(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in) const {
    DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
    DQ_RETURN_IF_ERROR(ValidateChunkHeader(h, id(), plan, chunk, bytes_ * chunk.count));
    if (h.element_bits != 8 * bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(CodecName(id()), " chunk with element_bits ", h.element_bits));
    }
    return h;
  }

  // Decodes elements [i, i + n) of the chunk in `in` (already validated).
  void DecodeTile(absl::Span<const uint8_t> in, size_t i, size_t n, float* tile) const {
    const uint8_t* p = in.data() + kChunkHeaderBytes + bytes_ * i;
    if (bytes_ == 4) {
      std::memcpy(tile, p, 4 * n);
    } else {
      for (size_t k = 0; k < n; ++k) tile[k] = Bf16ToFloat(static_cast<uint16_t>(p[2 * k] | (p[2 * k + 1] << 8)));
    }
  }

  template <typename Fn>
  absl::StatusOr<size_t> Encode(const BucketPlan& plan, const ChunkRef& chunk, uint16_t summands,
                                absl::Span<uint8_t> out, Fn&& fill) const {
    const size_t total = MaxEncodedBytes(plan, chunk);
    if (out.size() < total || chunk.count > kMaxChunkElements) {
      return absl::InvalidArgumentError(absl::StrCat("output buffer of ", out.size(), " bytes, need ", total));
    }
    ChunkHeader h;
    h.codec = id();
    h.element_bits = static_cast<uint8_t>(8 * bytes_);
    h.num_elements = static_cast<uint32_t>(chunk.count);
    h.chunk_id = chunk.chunk_id;
    h.round = static_cast<uint32_t>(plan.round.round);
    h.num_summands = summands;
    h.payload_bytes = static_cast<uint32_t>(bytes_ * chunk.count);
    WriteChunkHeader(h, out);
    uint8_t* p = out.data() + kChunkHeaderBytes;
    float tile[kTile];
    for (size_t i = 0; i < chunk.count; i += kTile) {
      const size_t n = std::min(kTile, chunk.count - i);
      fill(chunk.begin + i, n, tile);
      if (bytes_ == 4) {
        std::memcpy(p + 4 * i, tile, 4 * n);
      } else {
        for (size_t k = 0; k < n; ++k) {
          const uint16_t b = FloatToBf16(tile[k]);
          p[2 * (i + k)] = static_cast<uint8_t>(b);
          p[2 * (i + k) + 1] = static_cast<uint8_t>(b >> 8);
        }
      }
    }
    return total;
  }

  size_t bytes_;
};

}  // namespace

std::unique_ptr<Codec> NewSimpleCodec(const CodecConfig& config) { return std::make_unique<SimpleCodec>(config); }

}  // namespace dynamiq::kernels
