// Per-element and per-block math of the OCP Microscaling (MX v1.0) codecs MXFP8 (E4M3), MXFP6
// (E3M2) and MXFP4 (E2M1), shared by the CPU codec (scalar and Highway loops) and CUDA kernels,
// which must all produce identical bytes.
//
// Layout of one block of kMxBlockSize = 32 elements with code width w in {8, 6, 4}:
//   [ u8 E8M0 scale byte ][ 32 codes, w bits each, packed LSB-first: code k at bit (k*w) % 8 of
//                           byte (k*w) / 8 of the code area (4*w bytes; a 6-bit code may straddle
//                           two bytes) ]
// A chunk's last block may cover fewer than 32 elements; it still carries 32 codes and the
// padding codes are 0.
//
// Element code: [sign][E exponent bits][M mantissa bits], IEEE-like with bias B, no Inf,
// subnormals when the exponent field is 0. E4M3's magnitude 0x7F (S.1111.111) is NaN: the encoder
// never emits it and the decoder rejects it. E3M2 and E2M1 have no special codes.
//
// Encoding a block: shared_exp = floor(log2(max|v|)) - emax_elem, clamped to [-127, 127], read
// exactly from the float exponent bits (an all-zero or subnormal max gives -127); scale byte =
// shared_exp + 127. Each element v is rounded to nearest, ties to even, onto the element grid of
// v / 2^shared_exp and saturated at the max normal (values in the top of the largest binade, e.g.
// (448, 512) for E4M3, clip to max). All integer arithmetic on the float's bits: no log2f, no
// rounding-mode or FMA dependence, so host and device agree bit for bit.
//
// Decoding: element value * 2^(byte - 127). Both factors are short dyadic numbers and the product
// is exact in fp32 (smallest step 2^-9 * 2^-127 >= 2^-149), as long as the device does not flush
// subnormals (no -ftz / --use_fast_math for the kernels using this header). A scale byte the
// encoder never writes (above 254 - emax_elem) can make large codes decode to Inf; that is an
// overflow, not malformed input.
//
// Non-finite policy (same as DynamiQ): a block holding Inf or NaN is sent as scale byte 0xFF
// (E8M0 NaN) with all-zero codes and decodes to NaN everywhere, so overflow detection still sees
// it after the all-reduce. A 0xFF block with non-zero codes is rejected.
#ifndef DQ_KERNELS_MX_MATH_H_
#define DQ_KERNELS_MX_MATH_H_

#include <stddef.h>
#include <stdint.h>

#include "kernels/bf16_math.h"
#include "kernels/host_device.h"

namespace dynamiq::kernels {

inline constexpr int kMxBlockSize = 32;
inline constexpr uint8_t kMxNanScale = 0xFF;          // E8M0 NaN: the block held Inf/NaN
inline constexpr uint32_t kMxQuietNan = 0x7fc00000u;  // what a NaN block decodes to

// Parameters of one MX element format. Plain data.
struct MxElementFormat {
  int32_t bits;       // code width w: 8 (E4M3), 6 (E3M2) or 4 (E2M1)
  int32_t man_bits;   // M
  int32_t bias;       // B
  int32_t emax;       // emax_elem: unbiased exponent of the largest binade
  uint32_t max_code;  // magnitude code of the max normal (448 / 28 / 6)
  bool has_nan;       // E4M3: magnitude 0x7F is NaN
};

// The format for code width 8, 6 or 4 (anything else gives E2M1).
DQ_HOST_DEVICE constexpr MxElementFormat MxFormatForBits(int bits) {
  if (bits == 8) return MxElementFormat{8, 3, 7, 8, 0x7eu, true};
  if (bits == 6) return MxElementFormat{6, 2, 3, 4, 0x1fu, false};
  return MxElementFormat{4, 1, 1, 2, 0x7u, false};
}

// Bytes of one block: scale byte + 32 codes.
DQ_HOST_DEVICE constexpr int MxBlockBytes(int bits) { return 1 + kMxBlockSize * bits / 8; }

DQ_HOST_DEVICE size_t MxNumBlocks(size_t count) { return (count + kMxBlockSize - 1) / kMxBlockSize; }

// Payload bytes of a chunk of `count` elements.
DQ_HOST_DEVICE size_t MxPayloadBytes(int bits, size_t count) {
  return MxNumBlocks(count) * static_cast<size_t>(MxBlockBytes(bits));
}

// 2^k as a float for -126 <= k <= 127.
DQ_HOST_DEVICE float MxPow2(int k) { return BitsToFloat(static_cast<uint32_t>(k + 127) << 23); }

// Scale byte for a block whose largest magnitude has float bits `max_abs_bits` (sign cleared).
// Equals clamp(floor(log2 max) - emax, -127, 127) + 127; kMxNanScale if the block is not finite.
DQ_HOST_DEVICE uint8_t MxScaleByte(const MxElementFormat& f, uint32_t max_abs_bits) {
  if (max_abs_bits >= 0x7f800000u) return kMxNanScale;
  const int biased_exp = static_cast<int>(max_abs_bits >> 23);  // 0 for zero and subnormals
  return static_cast<uint8_t>(biased_exp > f.emax ? biased_exp - f.emax : 0);
}

// 2^(byte - 127) for byte 0..254 (byte 0 is the fp32 subnormal 2^-127).
DQ_HOST_DEVICE float MxScaleValue(uint8_t byte) {
  return byte == 0 ? BitsToFloat(0x00400000u) : BitsToFloat(static_cast<uint32_t>(byte) << 23);
}

// Code of v / 2^shared_exp, -127 <= shared_exp <= 127: round to nearest even on the element grid,
// saturating at the max normal. v must be finite. The sign is kept (-0 encodes as sign bit only).
DQ_HOST_DEVICE uint32_t MxEncodeElement(const MxElementFormat& f, float v, int shared_exp) {
  const uint32_t u = FloatBits(v);
  const uint32_t sign = u >> 31;
  const uint32_t a = u & 0x7fffffffu;
  const int fexp = static_cast<int>(a >> 23);
  // |v| = sig * 2^e0 exactly, with sig < 2^24.
  const uint32_t sig = fexp != 0 ? (a & 0x7fffffu) | 0x800000u : a;
  const int e0 = (fexp != 0 ? fexp : 1) - 150;
  // floor(log2(sig)): sig < 2^24 converts to float exactly (sig = 0 gives -127, still harmless).
  const int log2_sig = static_cast<int>(FloatBits(static_cast<float>(sig)) >> 23) - 127;
  // Exponent of the element's binade, floored at the min normal exponent (subnormal quantum).
  int elem_exp = log2_sig + e0 - shared_exp;
  if (elem_exp < 1 - f.bias) elem_exp = 1 - f.bias;
  // t = RNE(|v| / 2^shared_exp / quantum) with quantum = 2^(elem_exp - M): shift sig right by r.
  const int r = elem_exp - f.man_bits + shared_exp - e0;
  uint32_t t;
  if (r <= 0) {
    t = sig << -r;  // only a subnormal v with few significant bits: exact
  } else {
    const int s = r < 31 ? r : 31;  // sig < 2^24: any shift >= 25 rounds to 0 anyway
    const uint32_t q = sig >> s;
    const uint32_t rem = sig & ((1u << s) - 1u);
    const uint32_t half = 1u << (s - 1);
    t = q + ((rem > half || (rem == half && (q & 1u) != 0u)) ? 1u : 0u);
  }
  // Biased exponent field times 2^M plus t (t = 2^(M+1) carries into the next binade correctly;
  // for subnormals the first term is 0 and t = 2^M is the min normal).
  uint32_t mag = (static_cast<uint32_t>(elem_exp + f.bias - 1) << f.man_bits) + t;
  if (mag > f.max_code) mag = f.max_code;
  return (sign << (f.bits - 1)) | mag;
}

// The (unscaled) value of a code. E4M3 NaN codes decode as if finite (480): validate first.
DQ_HOST_DEVICE float MxDecodeElement(const MxElementFormat& f, uint32_t code) {
  const uint32_t mag = code & ((1u << (f.bits - 1)) - 1u);
  const int exp_field = static_cast<int>(mag >> f.man_bits);
  const uint32_t man = mag & ((1u << f.man_bits) - 1u);
  const uint32_t sig = exp_field != 0 ? man | (1u << f.man_bits) : man;
  const float v = static_cast<float>(sig) * MxPow2((exp_field != 0 ? exp_field : 1) - f.bias - f.man_bits);
  return ((code >> (f.bits - 1)) & 1u) != 0u ? -v : v;
}

// True for codes the encoder never emits and decoders reject (E4M3 S.1111.111).
DQ_HOST_DEVICE bool MxIsIllegalCode(const MxElementFormat& f, uint32_t code) {
  return f.has_nan && (code & 0x7fu) == 0x7fu;
}

DQ_HOST_DEVICE uint32_t MxUnpackCode(const uint8_t* codes, int k, int bits) {
  const int bit = k * bits;
  const int shift = bit & 7;
  uint32_t v = static_cast<uint32_t>(codes[bit >> 3]) >> shift;
  if (shift + bits > 8) v |= static_cast<uint32_t>(codes[(bit >> 3) + 1]) << (8 - shift);
  return v & ((1u << bits) - 1u);
}

// ORs `code` into a zero-initialised code area.
DQ_HOST_DEVICE void MxPackCode(uint8_t* codes, int k, int bits, uint32_t code) {
  const int bit = k * bits;
  const int shift = bit & 7;
  const uint32_t v = code << shift;
  codes[bit >> 3] = static_cast<uint8_t>(codes[bit >> 3] | (v & 0xffu));
  if (shift + bits > 8) codes[(bit >> 3) + 1] = static_cast<uint8_t>(codes[(bit >> 3) + 1] | (v >> 8));
}

// Encodes v[0, count), 1 <= count <= 32 (the rest is padding, code 0), into `block`, which must
// hold MxBlockBytes(f.bits) bytes.
DQ_HOST_DEVICE void MxEncodeBlock(const MxElementFormat& f, const float* v, int count, uint8_t* block) {
  uint32_t max_bits = 0;
  for (int k = 0; k < count; ++k) {
    const uint32_t a = FloatBits(v[k]) & 0x7fffffffu;
    max_bits = a > max_bits ? a : max_bits;
  }
  const uint8_t scale = MxScaleByte(f, max_bits);
  block[0] = scale;
  uint8_t* codes = block + 1;
  for (int b = 0; b < kMxBlockSize * f.bits / 8; ++b) codes[b] = 0;
  if (scale == kMxNanScale) return;
  const int shared_exp = static_cast<int>(scale) - 127;
  for (int k = 0; k < count; ++k) MxPackCode(codes, k, f.bits, MxEncodeElement(f, v[k], shared_exp));
}

// What MxValidateBlock found.
enum MxBlockStatus : int {
  kMxBlockOk = 0,
  kMxBlockIllegalCode = 1,     // an E4M3 NaN code
  kMxBlockNanWithCodes = 2,    // scale 0xFF but a non-zero code
  kMxBlockPaddingNotZero = 3,  // a code past `count` is not 0
};

// Checks one received block of `count` (1..32) elements. Peers may send anything; nothing is
// decoded before this passes. On failure *bad_element is the offending element (0..31).
DQ_HOST_DEVICE int MxValidateBlock(const MxElementFormat& f, const uint8_t* block, int count, int* bad_element) {
  const uint8_t* codes = block + 1;
  const bool nan_block = block[0] == kMxNanScale;
  for (int k = 0; k < kMxBlockSize; ++k) {
    const uint32_t code = MxUnpackCode(codes, k, f.bits);
    int status = kMxBlockOk;
    if (k >= count && code != 0u) {
      status = kMxBlockPaddingNotZero;
    } else if (nan_block && code != 0u) {
      status = kMxBlockNanWithCodes;
    } else if (MxIsIllegalCode(f, code)) {
      status = kMxBlockIllegalCode;
    }
    if (status != kMxBlockOk) {
      *bad_element = k;
      return status;
    }
  }
  return kMxBlockOk;
}

// Decodes a validated block into out[0, count).
DQ_HOST_DEVICE void MxDecodeBlock(const MxElementFormat& f, const uint8_t* block, int count, float* out) {
  if (block[0] == kMxNanScale) {
    for (int k = 0; k < count; ++k) out[k] = BitsToFloat(kMxQuietNan);
    return;
  }
  const float scale = MxScaleValue(block[0]);
  for (int k = 0; k < count; ++k) out[k] = MxDecodeElement(f, MxUnpackCode(block + 1, k, f.bits)) * scale;
}

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_MX_MATH_H_
