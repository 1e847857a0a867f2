// MxCodec (see mx_codec.h). Highway compiles the per-target section below once per SIMD target
// (foreach_target re-includes this file); the block encoder there mirrors MxEncodeElement of
// kernels/mx_math.h operation for operation (integer ops plus one exact int->float conversion),
// so every target writes the same bytes as the scalar math.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/mx_codec.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/cpu/mx_codec.h"
#include "kernels/mx_math.h"
#include "kernels/wire_format.h"

// Target-independent helpers, compiled once (foreach_target includes this file per target).
#ifndef DQ_KERNELS_CPU_MX_CODEC_CC_ONCE_
#define DQ_KERNELS_CPU_MX_CODEC_CC_ONCE_
namespace dynamiq::kernels::mx_internal {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "code packing assumes a little-endian host");

inline uint64_t LoadLE64(const uint8_t* p) {
  uint64_t w;
  memcpy(&w, p, 8);
  return w;
}

// Packs 32 one-byte codes of kBits bits LSB-first (the layout of mx_math.h's MxPackCode), 8 codes
// at a time by squeezing out the unused high bits of each byte (SWAR).
template <int kBits>
inline void PackCodes(const uint8_t* c, uint8_t* out) {
  static_assert(kBits == 8 || kBits == 6 || kBits == 4);
  if constexpr (kBits == 8) {
    memcpy(out, c, kMxBlockSize);
    return;
  }
  for (int j = 0; j < kMxBlockSize / 8; ++j) {
    uint64_t x = LoadLE64(c + 8 * j);
    if constexpr (kBits == 6) {
      x = (x & 0x003f003f003f003full) | ((x & 0x3f003f003f003f00ull) >> 2);  // 12 bits per 16
      x = (x & 0x00000fff00000fffull) | ((x & 0x0fff00000fff0000ull) >> 4);  // 24 bits per 32
      x = (x & 0xffffffull) | ((x >> 32) << 24);                             // 48 bits
    } else {
      x = (x & 0x000f000f000f000full) | ((x & 0x0f000f000f000f00ull) >> 4);  // 8 bits per 16
      x = (x & 0x000000ff000000ffull) | ((x & 0x00ff000000ff0000ull) >> 8);  // 16 bits per 32
      x = (x & 0xffffull) | ((x >> 32) << 16);                               // 32 bits
    }
    for (int i = 0; i < kBits; ++i) out[kBits * j + i] = static_cast<uint8_t>(x >> (8 * i));
  }
}

template <int kBits>
inline void UnpackCodes(const uint8_t* in, uint32_t* c) {
  if constexpr (kBits == 8) {
    for (int k = 0; k < kMxBlockSize; ++k) c[k] = in[k];
  } else if constexpr (kBits == 4) {
    for (int j = 0; j < kMxBlockSize / 2; ++j) {
      c[2 * j] = in[j] & 0xfu;
      c[2 * j + 1] = in[j] >> 4;
    }
  } else {
    static_assert(kBits == 6);
    for (int g = 0; g < kMxBlockSize / 4; ++g) {
      const uint32_t w = in[3 * g] | (in[3 * g + 1] << 8) | (static_cast<uint32_t>(in[3 * g + 2]) << 16);
      for (int j = 0; j < 4; ++j) c[4 * g + j] = (w >> (6 * j)) & 0x3fu;
    }
  }
}

// Decodes a validated block into tile[0, count) through the codec's code -> value table; the same
// values as MxDecodeBlock (element value times the power-of-two scale is exact).
template <int kBits>
inline void DecodeBlock(const float* table, const uint8_t* block, int count, float* tile) {
  if (block[0] == kMxNanScale) {
    for (int k = 0; k < count; ++k) tile[k] = BitsToFloat(kMxQuietNan);
    return;
  }
  const float scale = MxScaleValue(block[0]);
  uint32_t c[kMxBlockSize];
  UnpackCodes<kBits>(block + 1, c);
  for (int k = 0; k < count; ++k) tile[k] = table[c[k]] * scale;
}

}  // namespace dynamiq::kernels::mx_internal
#endif  // DQ_KERNELS_CPU_MX_CODEC_CC_ONCE_

// ---- Per-target SIMD code.
HWY_BEFORE_NAMESPACE();
namespace dynamiq::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Encodes tile[0, 32) (zero beyond the chunk's end) into one block; same bytes as MxEncodeBlock.
template <int kBits>
HWY_INLINE void EncodeTile(const float* HWY_RESTRICT tile, uint8_t* HWY_RESTRICT block) {
  constexpr MxElementFormat kF = MxFormatForBits(kBits);
  constexpr int kM = kF.man_bits;
  const hn::ScalableTag<int32_t> di;
  const hn::RebindToUnsigned<decltype(di)> du;
  const hn::RebindToFloat<decltype(di)> df;
  const size_t n = hn::Lanes(di);
  const auto zero = hn::Zero(di);
  const auto one = hn::Set(di, 1);
  const auto abs_mask = hn::Set(di, 0x7fffffff);

  // Block max of |v| as bits: < 2^31, so a signed max orders them like the magnitudes.
  auto vmax = zero;
  for (size_t k = 0; k < kMxBlockSize; k += n) {
    vmax = hn::Max(vmax, hn::And(hn::BitCast(di, hn::LoadU(df, tile + k)), abs_mask));
  }
  const uint8_t scale = MxScaleByte(kF, static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, vmax))));
  block[0] = scale;
  if (scale == kMxNanScale) {
    memset(block + 1, 0, kMxBlockSize * kBits / 8);
    return;
  }
  const auto shared_exp = hn::Set(di, static_cast<int32_t>(scale) - 127);

  const hn::Rebind<uint8_t, decltype(di)> d8;
  HWY_ALIGN uint8_t codes[kMxBlockSize];
  for (size_t k = 0; k < kMxBlockSize; k += n) {
    const auto u = hn::BitCast(di, hn::LoadU(df, tile + k));
    const auto a = hn::And(u, abs_mask);
    const auto fexp = hn::ShiftRight<23>(a);
    const auto is_normal = hn::Ne(fexp, zero);
    const auto sig = hn::IfThenElse(is_normal, hn::Or(hn::And(a, hn::Set(di, 0x7fffff)), hn::Set(di, 0x800000)), a);
    const auto e0 = hn::Sub(hn::Max(fexp, one), hn::Set(di, 150));
    const auto log2_sig = hn::Sub(hn::ShiftRight<23>(hn::BitCast(di, hn::ConvertTo(df, sig))), hn::Set(di, 127));
    const auto elem_exp = hn::Max(hn::Sub(hn::Add(log2_sig, e0), shared_exp), hn::Set(di, 1 - kF.bias));
    const auto r = hn::Sub(hn::Add(hn::Sub(elem_exp, hn::Set(di, kM)), shared_exp), e0);
    // r <= 0: exact left shift; else round to nearest even after shifting right by min(r, 31).
    const auto sig_u = hn::BitCast(du, sig);
    const auto left = hn::BitCast(di, hn::Shl(sig_u, hn::BitCast(du, hn::Max(hn::Neg(r), zero))));
    const auto s = hn::BitCast(du, hn::Min(hn::Max(r, one), hn::Set(di, 31)));
    const auto q = hn::Shr(sig_u, s);
    const auto rem = hn::BitCast(di, hn::Sub(sig_u, hn::Shl(q, s)));
    const auto half = hn::BitCast(di, hn::Shl(hn::Set(du, 1), hn::Sub(s, hn::Set(du, 1))));
    const auto qi = hn::BitCast(di, q);
    const auto odd = hn::Ne(hn::And(qi, one), zero);
    const auto up = hn::Or(hn::Gt(rem, half), hn::And(hn::Eq(rem, half), odd));
    const auto t = hn::IfThenElse(hn::Gt(r, zero), hn::IfThenElse(up, hn::Add(qi, one), qi), left);
    auto mag = hn::Add(hn::ShiftLeft<kM>(hn::Add(elem_exp, hn::Set(di, kF.bias - 1))), t);
    mag = hn::Min(mag, hn::Set(di, static_cast<int32_t>(kF.max_code)));
    const auto sign = hn::ShiftLeft<kBits - 1>(hn::BitCast(di, hn::ShiftRight<31>(hn::BitCast(du, u))));
    hn::StoreU(hn::DemoteTo(d8, hn::Or(sign, mag)), d8, codes + k);  // codes are 0..255
  }
  mx_internal::PackCodes<kBits>(codes, block + 1);
}

template <int kBits>
void CompressBlocksT(const Source& local, size_t begin, size_t count, uint8_t* payload) {
  constexpr int kBlockBytes = MxBlockBytes(kBits);
  HWY_ALIGN float tile[kMxBlockSize];
  for (size_t i = 0; i < count; i += kMxBlockSize) {
    const size_t n = std::min<size_t>(kMxBlockSize, count - i);
    if (n < kMxBlockSize) std::fill(tile + n, tile + kMxBlockSize, 0.0f);
    LoadSource(local, begin + i, n, tile);
    EncodeTile<kBits>(tile, payload + (i / kMxBlockSize) * kBlockBytes);
  }
}

// One pass per block: decode the received block, add the local values, re-encode.
template <int kBits>
void DarBlocksT(const float* table, const uint8_t* in, const Source& local, size_t begin, size_t count, uint8_t* out) {
  constexpr int kBlockBytes = MxBlockBytes(kBits);
  HWY_ALIGN float tile[kMxBlockSize];
  HWY_ALIGN float sum[kMxBlockSize];
  for (size_t i = 0; i < count; i += kMxBlockSize) {
    const size_t n = std::min<size_t>(kMxBlockSize, count - i);
    const size_t offset = (i / kMxBlockSize) * kBlockBytes;
    if (n < kMxBlockSize) std::fill(sum + n, sum + kMxBlockSize, 0.0f);
    LoadSource(local, begin + i, n, tile);
    mx_internal::DecodeBlock<kBits>(table, in + offset, static_cast<int>(n), sum);
    for (size_t k = 0; k < n; ++k) sum[k] += tile[k];
    EncodeTile<kBits>(sum, out + offset);
  }
}

void CompressBlocks(int bits, const Source& local, size_t begin, size_t count, uint8_t* payload) {
  if (bits == 8) return CompressBlocksT<8>(local, begin, count, payload);
  if (bits == 6) return CompressBlocksT<6>(local, begin, count, payload);
  return CompressBlocksT<4>(local, begin, count, payload);
}

void DarBlocks(int bits, const float* table, const uint8_t* in, const Source& local, size_t begin, size_t count,
               uint8_t* out) {
  if (bits == 8) return DarBlocksT<8>(table, in, local, begin, count, out);
  if (bits == 6) return DarBlocksT<6>(table, in, local, begin, count, out);
  return DarBlocksT<4>(table, in, local, begin, count, out);
}

}  // namespace HWY_NAMESPACE
}  // namespace dynamiq::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace dynamiq::kernels {

HWY_EXPORT(CompressBlocks);
HWY_EXPORT(DarBlocks);

namespace {

using mx_internal::DecodeBlock;

// Calls sink(first element index within the chunk, n, decoded tile) for every block of a
// validated payload.
template <int kBits, typename Sink>
void DecodeBlocksT(const float* table, const uint8_t* payload, size_t count, Sink&& sink) {
  constexpr int kBlockBytes = MxBlockBytes(kBits);
  float tile[kMxBlockSize];
  for (size_t i = 0; i < count; i += kMxBlockSize) {
    const size_t n = std::min<size_t>(kMxBlockSize, count - i);
    DecodeBlock<kBits>(table, payload + (i / kMxBlockSize) * kBlockBytes, static_cast<int>(n), tile);
    sink(i, n, tile);
  }
}

template <typename Sink>
void DecodeBlocks(int bits, const float* table, const uint8_t* payload, size_t count, Sink&& sink) {
  if (bits == 8) return DecodeBlocksT<8>(table, payload, count, sink);
  if (bits == 6) return DecodeBlocksT<6>(table, payload, count, sink);
  return DecodeBlocksT<4>(table, payload, count, sink);
}

// Cheap check of a full block, 8 code bytes at a time; false means "run MxValidateBlock to find
// out".
bool FullBlockLooksValid(const MxElementFormat& f, const uint8_t* block) {
  const int words = kMxBlockSize * f.bits / 64;
  const uint8_t* codes = block + 1;
  const bool nan_block = block[0] == kMxNanScale;
  if (!nan_block && !f.has_nan) return true;
  uint64_t bad = 0;
  for (int j = 0; j < words; ++j) {
    uint64_t w = 0;
    for (int i = 0; i < 8; ++i) w |= static_cast<uint64_t>(codes[8 * j + i]) << (8 * i);
    if (nan_block) {
      bad |= w;  // every code must be 0
    } else {
      // E4M3: a byte with its low 7 bits set, i.e. a zero byte in ~(w | 0x80..80).
      const uint64_t z = ~(w | 0x8080808080808080ull);
      bad |= (z - 0x0101010101010101ull) & ~z & 0x8080808080808080ull;
    }
  }
  return bad == 0;
}

std::string FormatName(const MxElementFormat& f) { return f.bits == 8 ? "mxfp8" : (f.bits == 6 ? "mxfp6" : "mxfp4"); }

std::string ElementName(const MxElementFormat& f) { return f.bits == 8 ? "E4M3" : (f.bits == 6 ? "E3M2" : "E2M1"); }

}  // namespace

MxCodec::MxCodec(const CodecConfig& config)
    : Codec(config),
      format_(MxFormatForBits(config.id == CodecId::kMxfp8 ? 8 : (config.id == CodecId::kMxfp6 ? 6 : 4))) {
  for (uint32_t code = 0; code < 256; ++code) {
    decode_[code] = code < (1u << format_.bits) ? MxDecodeElement(format_, code) : 0.0f;
  }
}

std::string MxCodec::Describe() const {
  return absl::StrCat(FormatName(format_), ": OCP MX ", ElementName(format_), " elements, E8M0 scale per ",
                      kMxBlockSize, ", ", format_.bits, ".25 bits/coord + ", kChunkHeaderBytes, " B header per chunk");
}

size_t MxCodec::MaxEncodedBytes(const BucketPlan&, const ChunkRef& chunk) const {
  return kChunkHeaderBytes + MxPayloadBytes(format_.bits, chunk.count);
}

ChunkHeader MxCodec::MakeHeader(const BucketPlan& plan, const ChunkRef& chunk, uint16_t num_summands) const {
  ChunkHeader h;
  h.codec = id();
  h.element_bits = static_cast<uint8_t>(format_.bits);
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = num_summands;
  h.payload_bytes = static_cast<uint32_t>(MxPayloadBytes(format_.bits, chunk.count));
  return h;
}

absl::StatusOr<size_t> MxCodec::CheckOutput(const BucketPlan& plan, const ChunkRef& chunk, size_t out_bytes) const {
  if (chunk.count > kMaxChunkElements) {
    return absl::InvalidArgumentError(absl::StrCat(FormatName(format_), " chunk ", chunk.chunk_id, " has ", chunk.count,
                                                   " elements; the limit is ", kMaxChunkElements));
  }
  if (chunk.begin > plan.num_elements || chunk.count > plan.num_elements - chunk.begin) {
    return absl::InvalidArgumentError(absl::StrCat(FormatName(format_), " chunk ", chunk.chunk_id, " [", chunk.begin,
                                                   ", +", chunk.count, ") exceeds the bucket of ", plan.num_elements,
                                                   " elements"));
  }
  const size_t payload = MxPayloadBytes(format_.bits, chunk.count);
  if (out_bytes < kChunkHeaderBytes + payload) {
    return absl::InvalidArgumentError(absl::StrCat(FormatName(format_), " output buffer of ", out_bytes,
                                                   " bytes is too small for chunk ", chunk.chunk_id, ": it needs ",
                                                   kChunkHeaderBytes + payload));
  }
  return payload;
}

absl::StatusOr<ChunkHeader> MxCodec::ParseAndValidate(const BucketPlan& plan, const ChunkRef& chunk,
                                                      absl::Span<const uint8_t> in) const {
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
  DQ_RETURN_IF_ERROR(ValidateChunkHeader(h, id(), plan, chunk, MxPayloadBytes(format_.bits, chunk.count)));
  if (h.element_bits != format_.bits || h.flags != 0 || h.param != 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(FormatName(format_), " chunk ", chunk.chunk_id,
                                                   " header has element_bits ", h.element_bits, ", flags ", h.flags,
                                                   ", param ", h.param, "; expected ", format_.bits, ", 0, 0"));
  }
  // Header and payload size match `chunk`, so every block below lies inside `in`.
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  const size_t block_bytes = MxBlockBytes(format_.bits);
  for (size_t i = 0; i < chunk.count; i += kMxBlockSize) {
    const size_t b = i / kMxBlockSize;
    const int n = static_cast<int>(std::min<size_t>(kMxBlockSize, chunk.count - i));
    const uint8_t* block = payload + b * block_bytes;
    if (n == kMxBlockSize && FullBlockLooksValid(format_, block)) continue;
    int bad = 0;
    const int status = MxValidateBlock(format_, block, n, &bad);
    if (status == kMxBlockOk) continue;
    const uint32_t code = MxUnpackCode(block + 1, bad, format_.bits);
    const std::string where = absl::StrCat(FormatName(format_), " chunk ", chunk.chunk_id, " block ", b, " element ",
                                           bad, ": code 0x", absl::Hex(code));
    switch (status) {
      case kMxBlockIllegalCode:
        return absl::DataLossError(absl::StrCat(where, " is the E4M3 NaN pattern, which encoders never emit"));
      case kMxBlockNanWithCodes:
        return absl::DataLossError(absl::StrCat(where, " in a NaN-scale (0xFF) block, whose codes must be 0"));
      default:
        return absl::DataLossError(absl::StrCat(where, " in the padding past the chunk's end, which must be 0"));
    }
  }
  return h;
}

absl::StatusOr<size_t> MxCodec::Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                         absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(const size_t payload, CheckOutput(plan, chunk, out.size()));
  HWY_DYNAMIC_DISPATCH(CompressBlocks)(format_.bits, local, chunk.begin, chunk.count, out.data() + kChunkHeaderBytes);
  WriteChunkHeader(MakeHeader(plan, chunk, 1), out);
  return kChunkHeaderBytes + payload;
}

absl::Status MxCodec::Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                 const Dest& out) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(plan, chunk, in).status());
  DecodeBlocks(format_.bits, decode_, in.data() + kChunkHeaderBytes, chunk.count,
               [&](size_t i, size_t n, const float* tile) { StoreDest(out, chunk.begin + i, n, tile); });
  return absl::OkStatus();
}

absl::Status MxCodec::DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                           float* acc) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(plan, chunk, in).status());
  DecodeBlocks(format_.bits, decode_, in.data() + kChunkHeaderBytes, chunk.count,
               [&](size_t i, size_t n, const float* tile) {
                 for (size_t k = 0; k < n; ++k) acc[i + k] += tile[k];
               });
  return absl::OkStatus();
}

absl::StatusOr<size_t> MxCodec::DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                               absl::Span<const uint8_t> in, const Source& local,
                                                               absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(const ChunkHeader h, ParseAndValidate(plan, chunk, in));
  DQ_ASSIGN_OR_RETURN(const size_t payload, CheckOutput(plan, chunk, out.size()));
  if (h.num_summands == UINT16_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(FormatName(format_), " chunk ", chunk.chunk_id, " already sums ",
                                                   h.num_summands, " contributions; one more does not fit"));
  }
  // Blocks are processed in order and each is read before it is written, so `out` may alias `in`.
  HWY_DYNAMIC_DISPATCH(DarBlocks)
  (format_.bits, decode_, in.data() + kChunkHeaderBytes, local, chunk.begin, chunk.count,
   out.data() + kChunkHeaderBytes);
  WriteChunkHeader(MakeHeader(plan, chunk, static_cast<uint16_t>(h.num_summands + 1)), out);
  return kChunkHeaderBytes + payload;
}

std::unique_ptr<Codec> NewMxCodec(const CodecConfig& config) {
  if (config.id != CodecId::kMxfp8 && config.id != CodecId::kMxfp6 && config.id != CodecId::kMxfp4) return nullptr;
  return std::make_unique<MxCodec>(config);
}

}  // namespace dynamiq::kernels
#endif  // HWY_ONCE
