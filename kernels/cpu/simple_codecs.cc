#include "kernels/cpu/simple_codecs.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/bf16_math.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/payload_checksum.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {
namespace {

// Works in tiles so no chunk-sized temporary is ever allocated.
constexpr size_t kTile = 1024;

// Plain fp32 memory (PlainFloats): the fast paths below read and write it directly, in one pass,
// instead of through tiles (in the CPU-bound regime these codecs' passes over memory are a third
// of an all-reduce's CPU time; scripts/bench-network --breakdown).

// The checksums a pass computes as it goes: of the bytes written (`out`), and of the received
// message it reads (`in`, over `in_bytes`), each when set.
struct PassSums {
  PayloadChecksummer* out = nullptr;
  PayloadChecksummer* in = nullptr;
  absl::Span<const uint8_t> in_bytes;
};

// Wire elements are little-endian, like every host this runs on (the wire format says so).
static_assert(std::endian::native == std::endian::little, "wire elements are little-endian");

float LoadWireFloat(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
float LoadWireBf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return Bf16ToFloat(h);
}

class SimpleCodec final : public Codec {
 public:
  explicit SimpleCodec(const CodecConfig& config) : Codec(config), bytes_(config.id == CodecId::kNone ? 4 : 2) {}

  std::string Describe() const override {
    return bytes_ == 4 ? "none: fp32, lossless, 32 bits/coord + 32 B header per chunk"
                       : "bf16: round to nearest even at every hop, 16 bits/coord + 32 B header per chunk";
  }

  bool ChecksumsWhileEncoding() const override { return true; }

  size_t MaxEncodedBytes(const BucketPlan&, const ChunkRef& chunk) const override {
    return kChunkHeaderBytes + bytes_ * chunk.count;
  }

  absl::StatusOr<size_t> Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                  absl::Span<uint8_t> out) const override {
    return CompressImpl(plan, chunk, local, out, PassSums{});
  }

  absl::StatusOr<size_t> CompressChecksummed(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                             absl::Span<uint8_t> out, uint64_t& checksum) const override {
    PayloadChecksummer summer;
    DQ_ASSIGN_OR_RETURN(const size_t bytes, CompressImpl(plan, chunk, local, out, PassSums{&summer}));
    checksum = summer.Finish();
    return bytes;
  }

  absl::Status Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                          const Dest& out) const override {
    DQ_ASSIGN_OR_RETURN(ChunkHeader h, Check(plan, chunk, in));
    (void)h;
    if (float* dst = chunk.count > 0 ? PlainFloats(out, chunk.begin) : nullptr) {
      const uint8_t* p = in.data() + kChunkHeaderBytes;
      if (bytes_ == 4) {
        std::memcpy(dst, p, 4 * chunk.count);
      } else {
        for (size_t k = 0; k < chunk.count; ++k) dst[k] = LoadWireBf16(p + 2 * k);
      }
      return absl::OkStatus();
    }
    float tile[kTile];
    for (size_t i = 0; i < chunk.count; i += kTile) {
      const size_t n = std::min(kTile, chunk.count - i);
      DecodeTile(in, i, n, tile);
      StoreDest(out, chunk.begin + i, n, tile);
    }
    return absl::OkStatus();
  }

  absl::Status DecompressVerified(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                  const Dest& out, uint64_t expected) const override {
    absl::StatusOr<ChunkHeader> h = Check(plan, chunk, in);
    if (!h.ok()) return PayloadChecksum(in) != expected ? PayloadChecksumError() : h.status();
    PayloadChecksummer summer;
    summer.Update(in.first(kChunkHeaderBytes));
    const uint8_t* p = in.data() + kChunkHeaderBytes;
    float* dst = chunk.count > 0 ? PlainFloats(out, chunk.begin) : nullptr;
    float tile[kTile];
    for (size_t i = 0; i < chunk.count; i += kTile) {  // each tile checksummed while in L1
      const size_t n = std::min(kTile, chunk.count - i);
      const uint8_t* src = p + bytes_ * i;
      if (dst == nullptr) {
        DecodeTile(in, i, n, tile);
        StoreDest(out, chunk.begin + i, n, tile);
      } else if (bytes_ == 4) {
        std::memcpy(dst + i, src, 4 * n);
      } else {
        for (size_t k = 0; k < n; ++k) dst[i + k] = LoadWireBf16(src + 2 * k);
      }
      summer.Update({src, bytes_ * n});
    }
    summer.Update(in.subspan(kChunkHeaderBytes + bytes_ * chunk.count));
    return summer.Finish() == expected ? absl::OkStatus() : PayloadChecksumError();
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
    return DarImpl(plan, chunk, in, local, out, PassSums{});
  }

  absl::StatusOr<size_t> DecompressAccumulateRecompressChecksummed(const BucketPlan& plan, const ChunkRef& chunk,
                                                                   absl::Span<const uint8_t> in, const Source& local,
                                                                   absl::Span<uint8_t> out,
                                                                   uint64_t& checksum) const override {
    PayloadChecksummer summer;
    DQ_ASSIGN_OR_RETURN(const size_t bytes, DarImpl(plan, chunk, in, local, out, PassSums{&summer}));
    checksum = summer.Finish();
    return bytes;
  }

  absl::StatusOr<size_t> DecompressAccumulateRecompressVerified(const BucketPlan& plan, const ChunkRef& chunk,
                                                                absl::Span<const uint8_t> in, uint64_t expected,
                                                                const Source& local, absl::Span<uint8_t> out,
                                                                uint64_t& checksum) const override {
    absl::StatusOr<ChunkHeader> h = Check(plan, chunk, in);
    if (!h.ok()) return PayloadChecksum(in) != expected ? PayloadChecksumError() : h.status();
    PayloadChecksummer in_sum, out_sum;
    in_sum.Update(in.first(kChunkHeaderBytes));
    DQ_ASSIGN_OR_RETURN(const size_t bytes, DarImpl(plan, chunk, in, local, out, PassSums{&out_sum, &in_sum, in}));
    in_sum.Update(in.subspan(kChunkHeaderBytes + bytes_ * chunk.count));
    if (in_sum.Finish() != expected) return PayloadChecksumError();
    checksum = out_sum.Finish();
    return bytes;
  }

  bool BodyIsFloat32() const override { return bytes_ == 4; }

  absl::Status WriteFloat32Head(const BucketPlan& plan, const ChunkRef& chunk,
                                absl::Span<uint8_t> head) const override {
    if (bytes_ != 4) return Codec::WriteFloat32Head(plan, chunk, head);
    return WriteHeader(plan, chunk, 1, head, kChunkHeaderBytes, nullptr);
  }

  absl::Status CheckFloat32Head(const BucketPlan& plan, const ChunkRef& chunk,
                                absl::Span<const uint8_t> head) const override {
    if (bytes_ != 4) return Codec::CheckFloat32Head(plan, chunk, head);
    DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseDetachedChunkHeader(head, 4 * chunk.count));
    return CheckParsed(plan, chunk, h).status();
  }

  absl::Status DecompressAccumulateRecompressSplit(const BucketPlan& plan, const ChunkRef& chunk,
                                                   absl::Span<const uint8_t> in, std::optional<uint64_t> expected,
                                                   const Source& local, absl::Span<uint8_t> head, float* body,
                                                   uint64_t& checksum) const override {
    if (bytes_ != 4) {
      return Codec::DecompressAccumulateRecompressSplit(plan, chunk, in, expected, local, head, body, checksum);
    }
    const float* src = chunk.count > 0 ? PlainFloats(local, chunk.begin) : nullptr;
    if (chunk.count > 0 && (src == nullptr || body == nullptr)) {
      return absl::InvalidArgumentError("a split DAR reads and writes plain fp32 memory");
    }
    absl::StatusOr<ChunkHeader> h = Check(plan, chunk, in);
    if (!h.ok()) return expected.has_value() && PayloadChecksum(in) != *expected ? PayloadChecksumError() : h.status();
    const uint16_t summands = h->num_summands == 0xffff ? h->num_summands : h->num_summands + 1;
    PayloadChecksummer in_sum, out_sum;
    in_sum.Update(in.first(kChunkHeaderBytes));
    const uint8_t* received = in.data() + kChunkHeaderBytes;
    // Element k is read before it is written: `body` may be `local` itself (an in-place all-reduce).
    DQ_RETURN_IF_ERROR(
        EncodeDirect(
            plan, chunk, summands, head, PassSums{&out_sum, expected.has_value() ? &in_sum : nullptr, in},
            [&](size_t k) { return LoadWireFloat(received + 4 * k) + src[k]; }, reinterpret_cast<uint8_t*>(body))
            .status());
    if (expected.has_value()) {
      in_sum.Update(in.subspan(kChunkHeaderBytes + 4 * chunk.count));
      if (in_sum.Finish() != *expected) return PayloadChecksumError();
    }
    checksum = out_sum.Finish();
    return absl::OkStatus();
  }

 private:
  // Compress and DAR, checksumming as they go what `sums` asks for.
  absl::StatusOr<size_t> CompressImpl(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                      absl::Span<uint8_t> out, const PassSums& sums) const {
    if (const float* src = chunk.count > 0 ? PlainFloats(local, chunk.begin) : nullptr) {
      return EncodeDirect(plan, chunk, 1, out, sums, [&](size_t k) { return src[k]; });
    }
    return Encode(plan, chunk, 1, out, sums,
                  [&](size_t begin, size_t n, float* tile) { LoadSource(local, begin, n, tile); });
  }

  absl::StatusOr<size_t> DarImpl(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                 const Source& local, absl::Span<uint8_t> out, const PassSums& sums) const {
    DQ_ASSIGN_OR_RETURN(ChunkHeader h, Check(plan, chunk, in));
    const uint16_t summands = h.num_summands == 0xffff ? h.num_summands : h.num_summands + 1;
    if (const float* src = chunk.count > 0 ? PlainFloats(local, chunk.begin) : nullptr) {
      const uint8_t* received = in.data() + kChunkHeaderBytes;
      if (bytes_ == 4) {
        return EncodeDirect(plan, chunk, summands, out, sums,
                            [&](size_t k) { return LoadWireFloat(received + 4 * k) + src[k]; });
      }
      return EncodeDirect(plan, chunk, summands, out, sums,
                          [&](size_t k) { return LoadWireBf16(received + 2 * k) + src[k]; });
    }
    return Encode(plan, chunk, summands, out, sums, [&](size_t begin, size_t n, float* tile) {
      float received[kTile];
      LoadSource(local, begin, n, tile);
      DecodeTile(in, begin - chunk.begin, n, received);
      for (size_t k = 0; k < n; ++k) tile[k] = received[k] + tile[k];
    });
  }

  absl::StatusOr<ChunkHeader> Check(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in) const {
    DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
    return CheckParsed(plan, chunk, h);
  }
  absl::StatusOr<ChunkHeader> CheckParsed(const BucketPlan& plan, const ChunkRef& chunk, const ChunkHeader& h) const {
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
      for (size_t k = 0; k < n; ++k) tile[k] = LoadWireBf16(p + 2 * k);
    }
  }

  // Checks `out` (`need` bytes: the whole message, or the header of a split one) and writes the
  // chunk header (and checksums it); the elements go after it, or to the split message's body.
  absl::Status WriteHeader(const BucketPlan& plan, const ChunkRef& chunk, uint16_t summands, absl::Span<uint8_t> out,
                           size_t need, PayloadChecksummer* summer) const {
    if (out.size() < need || chunk.count > kMaxChunkElements) {
      return absl::InvalidArgumentError(absl::StrCat("output buffer of ", out.size(), " bytes, need ", need));
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
    if (summer != nullptr) summer->Update(out.first(kChunkHeaderBytes));
    return absl::OkStatus();
  }

  // Checksums tile [i, i + n) as `sums` asks: the bytes just written at `dst`, the received ones.
  void AddTile(const PassSums& sums, const uint8_t* dst, size_t i, size_t n) const {
    if (sums.out != nullptr) sums.out->Update({dst, bytes_ * n});
    if (sums.in != nullptr) sums.in->Update(sums.in_bytes.subspan(kChunkHeaderBytes + bytes_ * i, bytes_ * n));
  }

  // Encodes value(k), k < chunk.count, in one pass (the fast path: `value` reads plain memory), in
  // tiles small enough that the checksums of each (`sums`) read it from L1.
  // `body`: where the elements go in a split message (`out` then holds only the header).
  template <typename Fn>
  absl::StatusOr<size_t> EncodeDirect(const BucketPlan& plan, const ChunkRef& chunk, uint16_t summands,
                                      absl::Span<uint8_t> out, const PassSums& sums, Fn&& value,
                                      uint8_t* body = nullptr) const {
    DQ_RETURN_IF_ERROR(WriteHeader(plan, chunk, summands, out,
                                   body != nullptr ? kChunkHeaderBytes : MaxEncodedBytes(plan, chunk), sums.out));
    uint8_t* p = body != nullptr ? body : out.data() + kChunkHeaderBytes;
    for (size_t i = 0; i < chunk.count; i += kTile) {
      const size_t n = std::min(kTile, chunk.count - i);
      uint8_t* dst = p + bytes_ * i;
      if (bytes_ == 4) {
        for (size_t k = 0; k < n; ++k) {
          const float v = value(i + k);
          std::memcpy(dst + 4 * k, &v, 4);
        }
      } else {  // two loops, so that both vectorize
        float values[kTile];
        uint16_t codes[kTile];
        for (size_t k = 0; k < n; ++k) values[k] = value(i + k);
        for (size_t k = 0; k < n; ++k) codes[k] = FloatToBf16(values[k]);
        std::memcpy(dst, codes, 2 * n);
      }
      AddTile(sums, dst, i, n);
    }
    return MaxEncodedBytes(plan, chunk);
  }

  // Encodes through tiles that `fill(begin, n, tile)` loads (conversions, per-group offsets).
  template <typename Fn>
  absl::StatusOr<size_t> Encode(const BucketPlan& plan, const ChunkRef& chunk, uint16_t summands,
                                absl::Span<uint8_t> out, const PassSums& sums, Fn&& fill) const {
    const size_t total = MaxEncodedBytes(plan, chunk);
    DQ_RETURN_IF_ERROR(WriteHeader(plan, chunk, summands, out, total, sums.out));
    uint8_t* p = out.data() + kChunkHeaderBytes;
    float tile[kTile];
    for (size_t i = 0; i < chunk.count; i += kTile) {
      const size_t n = std::min(kTile, chunk.count - i);
      fill(chunk.begin + i, n, tile);
      uint8_t* dst = p + bytes_ * i;
      if (bytes_ == 4) {
        std::memcpy(dst, tile, 4 * n);
      } else {
        uint16_t codes[kTile];
        for (size_t k = 0; k < n; ++k) codes[k] = FloatToBf16(tile[k]);
        std::memcpy(dst, codes, 2 * n);
      }
      AddTile(sums, dst, i, n);
    }
    return total;
  }

  size_t bytes_;
};

}  // namespace

std::unique_ptr<Codec> NewSimpleCodec(const CodecConfig& config) { return std::make_unique<SimpleCodec>(config); }

}  // namespace dynamiq::kernels
