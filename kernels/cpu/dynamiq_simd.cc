// Highway implementation of kernels/cpu/dynamiq_simd.h. Compiled once per SIMD target by
// foreach_target.h; HWY_DYNAMIC_DISPATCH picks the best target for the running CPU.
//
// Every arithmetic step mirrors kernels/dynamiq_math.h operation for operation (same operands,
// same order, no fused multiply-add), so results are bit-identical to the scalar reference. Where
// a step is computed differently (the interval search, the maxima), it provably gives the same
// value. Speed comes from:
//  - one pass over the input: load, subtract the offset, add the decoded received super-group
//    (DAR) and take the group maxima together; quantizing then reads a 1 KiB tile from L1;
//  - lookups as lane permutes: level tables of widths <= 6 fit in at most 4 registers; the
//    interval of a value is one bucket lookup plus one correction step, not a binary search;
//  - unpacking codes with a byte shuffle and a variable shift per vector, packing them with
//    multiply-adds on bytes; the rounding hash's index multiply becomes an add per vector.
// Vectors hold 4 (SSSE3, SSE4), 8 (AVX2) or 16 (AVX3: one group) floats. Other targets (EMU128,
// SCALAR, non-x86) run the scalar reference.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/dynamiq_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"
#include "kernels/cpu/dynamiq_simd.h"
#include "kernels/dynamiq_math.h"

#include <math.h>
#include <string.h>

HWY_BEFORE_NAMESPACE();
namespace dynamiq::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// x86 SIMD targets (SSSE3 and better have smaller target bits); not EMU128 or SCALAR.
#if !HWY_ARCH_X86 || HWY_TARGET > HWY_SSSE3

// The values LoadSource produces for a super-group.
void LoadInput(const SgInput& in, float* v) {
  for (int k = 0; k < kSuperGroupSize; ++k) {
    const float x =
        in.bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(in.data)[k]) : static_cast<const float*>(in.data)[k];
    v[k] = x - in.subtract;
  }
}

void CompressSg(const SimdLevelTable& t, const SgInput& in, const SgRounding& rnd, uint8_t* sg) {
  float v[kSuperGroupSize];
  LoadInput(in, v);
  EncodeSuperGroup(t.base, v, kSuperGroupSize, rnd.key, rnd.first_index, rnd.correlated, rnd.stratum, rnd.n, sg);
}

void DarSg(const SimdLevelTable& t, const uint8_t* received, const SgInput& in, const SgRounding& rnd, uint8_t* sg) {
  float v[kSuperGroupSize], decoded[kSuperGroupSize];
  LoadInput(in, v);
  DecodeSuperGroup(t.base, received, kSuperGroupSize, decoded);
  for (int k = 0; k < kSuperGroupSize; ++k) v[k] = v[k] + decoded[k];
  EncodeSuperGroup(t.base, v, kSuperGroupSize, rnd.key, rnd.first_index, rnd.correlated, rnd.stratum, rnd.n, sg);
}

bool ValidateSg(const SimdLevelTable& t, const uint8_t* sg) { return ValidateSuperGroup(t.base, sg, kSuperGroupSize); }

void DecodeSg(const SimdLevelTable& t, const uint8_t* sg, float* out) {
  DecodeSuperGroup(t.base, sg, kSuperGroupSize, out);
}

void DecodeAddSg(const SimdLevelTable& t, const uint8_t* sg, float* inout) {
  float decoded[kSuperGroupSize];
  DecodeSuperGroup(t.base, sg, kSuperGroupSize, decoded);
  for (int k = 0; k < kSuperGroupSize; ++k) inout[k] = inout[k] + decoded[k];
}

void DecodeOffsetSg(const SimdLevelTable& t, const uint8_t* sg, float offset, float* out) {
  DecodeSuperGroup(t.base, sg, kSuperGroupSize, out);
  for (int k = 0; k < kSuperGroupSize; ++k) out[k] = out[k] + offset;
}

#else  // x86 with SSSE3 or better

// At most one group (16 floats) per vector, so group reductions never cross groups.
using DF = hn::CappedTag<float, kGroupSize>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;
using VU = hn::Vec<DU>;
constexpr int kLanes = static_cast<int>(hn::MaxLanes(DF()));
constexpr int kVectorsPerGroup = kGroupSize / kLanes;
constexpr uint32_t kIndexMultiplier = 0x9e3779b1u;  // RandomBits: Mix32(index * this + key)

HWY_INLINE VU Mix32Simd(VU x) {
  const DU du;
  x = hn::Xor(x, hn::ShiftRight<16>(x));
  x = hn::Mul(x, hn::Set(du, 0x7feb352du));
  x = hn::Xor(x, hn::ShiftRight<15>(x));
  x = hn::Mul(x, hn::Set(du, 0x846ca68bu));
  x = hn::Xor(x, hn::ShiftRight<16>(x));
  return x;
}

#define DQ_AVX3 (HWY_TARGET <= HWY_AVX3)  // AVX-512 F/BW/DQ/VL: 16 floats, a whole group

// Float to int32, truncating, for values known to fit (Highway's ConvertTo adds an overflow fixup).
HWY_INLINE VI TruncateInRange(VF x) {
#if DQ_AVX3
  return VI{_mm512_cvttps_epi32(x.raw)};
#elif HWY_TARGET == HWY_AVX2
  return VI{_mm256_cvttps_epi32(x.raw)};
#else
  return VI{_mm_cvttps_epi32(x.raw)};
#endif
}

// A table of kEntries 32-bit values looked up with lane permutes while it fits in 4 registers
// (AVX-512: one vpermi2ps per 32 entries), else with gathers from memory.
template <typename T, int kEntries>
class LaneTable {
  using D = hn::Rebind<T, DF>;
  using V = hn::Vec<D>;
  static constexpr int kPieces = (kEntries + kLanes - 1) / kLanes;
  static constexpr bool kInRegisters = kPieces <= 4;

 public:
  // Holds table[0, kEntries) (whole vectors are read, so the array must extend that far).
  void Load(const T* table) {
    table_ = table;
    if constexpr (kInRegisters) {
      for (int p = 0; p < kPieces; ++p) piece_[p] = hn::LoadU(D(), table + p * kLanes);
    }
  }

  // table[idx] for 0 <= idx < kEntries.
  HWY_INLINE V Lookup(VI idx) const {
    const D d;
    const DI di;
    if constexpr (!kInRegisters) {
      return hn::GatherIndex(d, table_, idx);
    } else if constexpr (kPieces == 1) {
      return hn::TableLookupLanes(piece_[0], hn::IndicesFromVec(d, idx));
    } else {
#if DQ_AVX3
      // Highway 1.0 has no two-table lookup; vpermi2 indexes 32 entries in one instruction.
      auto two = [&](int p) {
        if constexpr (hwy::IsFloat<T>()) {
          return V{_mm512_permutex2var_ps(piece_[p].raw, idx.raw, piece_[p + 1].raw)};
        } else {
          return V{_mm512_permutex2var_epi32(piece_[p].raw, idx.raw, piece_[p + 1].raw)};
        }
      };
      if constexpr (kPieces == 2) {
        return two(0);
      } else {
        static_assert(kPieces == 4, "3 pieces do not occur: entries are powers of two");
        return hn::IfThenElse(hn::RebindMask(d, hn::TestBit(idx, hn::Set(di, 32))), two(2), two(0));
      }
#else
      const auto within = hn::IndicesFromVec(d, hn::And(idx, hn::Set(di, kLanes - 1)));
      V out = hn::TableLookupLanes(piece_[0], within);
      for (int p = 1; p < kPieces; ++p) {
        const auto hit = hn::RebindMask(d, hn::Gt(idx, hn::Set(di, p * kLanes - 1)));
        out = hn::IfThenElse(hit, hn::TableLookupLanes(piece_[p], within), out);
      }
      return out;
#endif
    }
  }

 private:
  const T* table_ = nullptr;
  V piece_[kInRegisters ? kPieces : 1];
};

// Unpacks the 16 W-bit codes of a group (layout in kernels/dynamiq_math.h), kLanes at a time: a
// byte shuffle moves the (at most two) bytes holding each code into its lane, then a variable
// shift and a mask extract it. The shuffle reads 16 bytes from the group's start; a super-group
// holds that many after every group but the last (2W + 3 bytes left for W < 7), whose 16 bytes
// are read ending at the super-group's end instead. 2-bit codes come from one 32-bit word,
// 8-bit codes are bytes.
template <int W>
class CodeUnpacker {
  static constexpr int kLastShift = W >= 3 && W <= 6 ? 16 - (2 * W + 3) : 0;

 public:
  CodeUnpacker() {
    const DU du;
    for (int v = 0; v < kVectorsPerGroup; ++v) {
      const VU bit = hn::Mul(hn::Add(hn::Iota(du, 0), hn::Set(du, v * kLanes)), hn::Set(du, W));
      if constexpr (W == 2) {
        shift_[v] = bit;
      } else {
        const VU byte = hn::ShiftRight<3>(bit);
        shift_[v] = hn::And(bit, hn::Set(du, 7));
        // Bytes b and b + 1 into the lane's low half; index bit 7 zeroes the upper half.
        index_[v] = hn::Or(hn::Or(byte, hn::ShiftLeft<8>(hn::Add(byte, hn::Set(du, 1)))), hn::Set(du, 0x80800000u));
        last_index_[v] = hn::Add(index_[v], hn::Set(du, kLastShift * 0x0101u));
      }
    }
  }

  // Codes [v * kLanes, (v + 1) * kLanes) of `group`; `last`: the last group of its super-group.
  HWY_INLINE VI Codes(const uint8_t* group, int v, bool last) const {
    const DI di;
    const DU du;
    if constexpr (W == 2) {
      uint32_t word;
      memcpy(&word, group, 4);
      return hn::BitCast(di, hn::And(hn::Shr(hn::Set(du, word), shift_[v]), hn::Set(du, 3)));
    } else if constexpr (W == 8) {
      return hn::PromoteTo(di, hn::LoadU(hn::Rebind<uint8_t, DI>(), group + v * kLanes));
    } else {
      const hn::Repartition<uint8_t, DU> d8;
      const bool shifted = kLastShift != 0 && last;
      const auto bytes = hn::LoadDup128(d8, shifted ? group - kLastShift : group);
      const VU pair =
          hn::BitCast(du, hn::TableLookupBytesOr0(bytes, hn::BitCast(d8, shifted ? last_index_[v] : index_[v])));
      return hn::BitCast(di, hn::And(hn::Shr(pair, shift_[v]), hn::Set(du, (1u << W) - 1u)));
    }
  }

 private:
  VU shift_[kVectorsPerGroup];
  VU index_[kVectorsPerGroup];
  VU last_index_[kVectorsPerGroup];
};

// Decoded levels of codes (LevelTable::decode): from registers up to 6 bits, arithmetically for
// wider uniform levels (level[r] = r * (1/L), as BuildLevelTable computes it), else gathered.
template <int W>
class LevelDecoder {
 public:
  explicit LevelDecoder(const LevelTable& t)
      : uniform_(t.uniform != 0), L_(hn::Set(DI(), t.max_level)), inv_L_(hn::Set(DF(), t.level[1])) {
    table_.Load(t.decode);
  }

  HWY_INLINE VF Levels(VI code) const {
    if (W <= 6 || !uniform_) return table_.Lookup(code);
    return hn::Mul(hn::ConvertTo(DF(), hn::Sub(code, L_)), inv_L_);
  }

 private:
  bool uniform_;
  VI L_;
  VF inv_L_;
  LaneTable<float, (1 << W)> table_;
};

// How QuantizeElement's interval r of a value is found.
enum class Search { kTwoBit, kUniform, kBucket, kGather };

// QuantizeElement for kLanes values at a time.
template <int W, Search kSearch>
class Quantizer {
 public:
  Quantizer(const SimdLevelTable& st, const SgRounding& rnd)
      : t_(st.base),
        corrections_(st.corrections),
        correlated_(rnd.correlated),
        top_level_(hn::Set(DF(), st.base.level[st.base.max_level])),
        inv_L_(hn::Set(DF(), st.base.level[1])),
        fL_(hn::Set(DF(), static_cast<float>(st.base.max_level))),
        L_(hn::Set(DI(), st.base.max_level)),
        stratum_(hn::Set(DF(), static_cast<float>(rnd.stratum))),
        inv_n_(hn::Set(DF(), 1.0f / static_cast<float>(rnd.n))) {
    if constexpr (kSearch == Search::kBucket) {
      bucket_.Load(st.bucket);
      above_.Load(st.above);
      level_.Load(st.base.level);
      inv_gap_.Load(st.base.inv_gap);
    }
  }

  // Codes of the values x, with 1 / group scale `inv`; `hash` = index * kIndexMultiplier + key.
  HWY_INLINE VI Codes(VF x, VF inv, VU hash) const {
    const DF df;
    const DI di;
    const VI one = hn::Set(di, 1);
    const VI top_interval = hn::Set(di, t_.max_level - 1);
    const VF a = hn::Min(hn::Mul(hn::Abs(x), inv), hn::Set(df, 1.0f));
    VI r;
    VF p;
    if constexpr (kSearch == Search::kTwoBit) {
      r = hn::Zero(di);
      p = a;  // level[0] = 0, inv_gap[0] = 1 (uniform: L = 1)
    } else if constexpr (kSearch == Search::kUniform) {
      r = hn::Min(TruncateInRange(hn::Mul(a, fL_)), top_interval);
      const auto down = hn::RebindMask(di, hn::Lt(a, hn::Mul(hn::ConvertTo(df, r), inv_L_)));
      const auto up = hn::And(hn::RebindMask(di, hn::Ge(a, hn::Mul(hn::ConvertTo(df, hn::Add(r, one)), inv_L_))),
                              hn::Lt(r, top_interval));
      r = hn::IfThenElse(down, hn::Sub(r, one), hn::IfThenElse(up, hn::Add(r, one), r));
      p = hn::Mul(hn::Sub(a, hn::Mul(hn::ConvertTo(df, r), inv_L_)), fL_);
    } else if constexpr (kSearch == Search::kBucket) {
      // a * 2^W is exact, so the bucket is floor(a * 2^W) and its interval is r or below.
      const VI idx = hn::Min(TruncateInRange(hn::Mul(a, hn::Set(df, 1 << W))), hn::Set(di, (1 << W) - 1));
      r = bucket_.Lookup(idx);
      auto step_up = [&] { r = hn::IfThenElse(hn::RebindMask(di, hn::Ge(a, above_.Lookup(r))), hn::Add(r, one), r); };
      step_up();  // the default levels need exactly one step
      for (int c = 1; c < corrections_; ++c) step_up();
      p = hn::Mul(hn::Sub(a, level_.Lookup(r)), inv_gap_.Lookup(r));
    } else {
      const VI idx = hn::Min(TruncateInRange(hn::Mul(a, hn::Set(df, kSearchBuckets))), hn::Set(di, kSearchBuckets - 1));
      r = hn::GatherIndex(di, t_.search, idx);
      const VF next = hn::GatherIndex(df, t_.level, hn::Add(r, one));
      r = hn::IfThenElse(hn::And(hn::RebindMask(di, hn::Ge(a, next)), hn::Lt(r, top_interval)), hn::Add(r, one), r);
      p = hn::Mul(hn::Sub(a, hn::GatherIndex(df, t_.level, r)), hn::GatherIndex(df, t_.inv_gap, r));
    }
    // Rounding threshold, as RoundingUnit().
    const VU bits = Mix32Simd(hash);
    VF u = hn::Mul(hn::ConvertTo(df, hn::BitCast(di, hn::ShiftRight<8>(bits))), hn::Set(df, 1.0f / 16777216.0f));
    if (correlated_) u = hn::Min(hn::Mul(hn::Add(stratum_, u), inv_n_), hn::Set(df, 0.99999994f));
    const auto round_up = hn::Or(hn::Lt(u, p), hn::Ge(a, top_level_));
    const VI q = hn::IfThenElse(hn::RebindMask(di, round_up), hn::Add(r, one), r);
    return hn::IfThenElse(hn::RebindMask(di, hn::Lt(x, hn::Zero(df))), hn::Sub(L_, q), hn::Add(L_, q));
  }

 private:
  static constexpr int kLevels = 1 << (W - 1);  // L + 1
  const LevelTable& t_;
  int corrections_;
  bool correlated_;
  VF top_level_, inv_L_, fL_;
  VI L_;
  VF stratum_, inv_n_;
  LaneTable<int32_t, (1 << W)> bucket_;
  LaneTable<float, kLevels> above_, level_, inv_gap_;
};

// Codes (0..254) as bytes in the low lanes of an SSE register.
HWY_INLINE __m128i CodeBytes(VI code) {
#if DQ_AVX3
  return _mm512_cvtepi32_epi8(code.raw);  // one instruction; Highway's DemoteTo takes four
#else
  return hn::DemoteTo(hn::Rebind<uint8_t, DI>(), code).raw;
#endif
}

// Merges W-bit codes given as bytes (W < 8) with multiply-adds: neighbours into pairs in 16-bit
// lanes, then into fours (4W bits) in 32-bit lanes.
template <int W>
HWY_INLINE __m128i MergeFours(__m128i bytes) {
  __m128i pairs;
  if constexpr (W <= 6) {
    pairs = _mm_maddubs_epi16(bytes, _mm_set1_epi16(static_cast<int16_t>(1 | (1 << (8 + W)))));
  } else {  // maddubs' signed byte factors stop at 127
    pairs = _mm_or_si128(_mm_and_si128(bytes, _mm_set1_epi16(0x7f)),
                         _mm_and_si128(_mm_srli_epi16(bytes, 1), _mm_set1_epi16(0x3f80)));
  }
  return _mm_madd_epi16(pairs, _mm_set1_epi32(1 | (1 << (16 + 2 * W))));
}

// Fours into eights: 8W bits (W whole bytes) in each 64-bit lane.
template <int W>
HWY_INLINE __m128i MergeEights(__m128i fours) {
  return _mm_or_si128(_mm_and_si128(fours, _mm_set1_epi64x(0xffffffffll)),
                      _mm_slli_epi64(_mm_srli_epi64(fours, 32), 4 * W));
}

#if DQ_AVX3
// Byte shuffle that gathers the low kBytes bytes of each 32-bit lane.
template <int kBytes>
struct PickBytes {
  alignas(16) int8_t index[16];
  constexpr PickBytes() : index() {
    for (int i = 0; i < 16; ++i) index[i] = static_cast<int8_t>(i < 4 * kBytes ? i / kBytes * 4 + i % kBytes : -1);
  }
};

// A whole group's 16 codes (W < 8) packed into the low 2W bytes of an SSE register.
template <int W>
HWY_INLINE __m128i PackGroup(VI code) {
  const __m128i fours = MergeFours<W>(CodeBytes(code));
  if constexpr (W % 2 == 0) {  // fours are W / 2 whole bytes: gather them
    static constexpr PickBytes<W / 2> kPick;
    return _mm_shuffle_epi8(fours, _mm_load_si128(reinterpret_cast<const __m128i*>(kPick.index)));
  } else {  // eights are W whole bytes: move the upper eight next to the lower
    const __m128i eights = MergeEights<W>(fours);
    return _mm_or_si128(_mm_move_epi64(eights), _mm_slli_si128(_mm_srli_si128(eights, 8), W));
  }
}

// Writes a packed group. A 16-byte store also covers the group's scale byte, the next group's
// start and, from the second-last group, maybe the super unit; all are written after it. The last
// group of a super-group (for 2-bit codes, every group) is written exactly.
template <int W>
HWY_INLINE void StoreGroup(__m128i packed, uint8_t* group, bool last) {
  if constexpr (W == 2) {
    const uint32_t codes = static_cast<uint32_t>(_mm_cvtsi128_si32(packed));
    memcpy(group, &codes, 4);
    return;
  }
  if (!last) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(group), packed);
    return;
  }
  const uint64_t lo = static_cast<uint64_t>(_mm_cvtsi128_si64(packed));
  memcpy(group, &lo, 2 * W < 8 ? 2 * W : 8);
  if constexpr (2 * W > 8) {
    const uint64_t hi = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_srli_si128(packed, 8)));
    memcpy(group + 8, &hi, 2 * W - 8);
  }
}
#else
// ORs codes [k0, k0 + kLanes) of a group (W < 8) into its two little-endian words (codes 0..7
// and 8..15).
template <int W>
HWY_INLINE void PackCodes(VI code, int k0, uint64_t* words) {
  const __m128i fours = MergeFours<W>(CodeBytes(code));
  if constexpr (kLanes == 4) {
    words[k0 / 8] |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_cvtsi128_si32(fours))) << ((k0 % 8) * W);
  } else {
    words[k0 / 8] = static_cast<uint64_t>(_mm_cvtsi128_si64(MergeEights<W>(fours)));
  }
}
#endif

#if DQ_AVX3
// Lane g = the largest lane of m[kSlot[g]], for 16 vectors: a transposing tree of 45 instructions
// instead of 16 horizontal reductions. The tree puts slot 4 * (l % 4) + l / 4 into lane l, so
// kSlot (the same permutation) lists the groups in that order.
constexpr int kSlot[kGroupsPerSuperGroup] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

HWY_INLINE VI MaxOfEach(const VI* m) {
  __m512i x[8], y[4];
  for (int i = 0; i < 8; ++i) {  // [slot 2i: 8 lanes, slot 2i + 1: 8 lanes]
    const __m512i a = m[2 * i].raw, b = m[2 * i + 1].raw;
    x[i] = _mm512_max_epi32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xee));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit block b: slot 4i + b, 4 lanes
    const __m512i a = x[2 * i], b = x[2 * i + 1];
    y[i] = _mm512_max_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
  }
  // Block b: slots b, 4 + b, 8 + b, 12 + b in lanes 0, 1, 2, 3.
  const __m512i c0 = _mm512_max_epi32(_mm512_unpacklo_epi32(y[0], y[1]), _mm512_unpackhi_epi32(y[0], y[1]));
  const __m512i c1 = _mm512_max_epi32(_mm512_unpacklo_epi32(y[2], y[3]), _mm512_unpackhi_epi32(y[2], y[3]));
  return VI{_mm512_max_epi32(_mm512_unpacklo_epi64(c0, c1), _mm512_unpackhi_epi64(c0, c1))};
}
#endif

// Pass 1 of an encode: the values to encode (input minus its offset, plus for DAR the decoded
// received super-group) into `tile`, and each group's largest |v| into group_max. Maxima are
// taken on the bit patterns of |v|, which order like the values and put Inf and NaN above every
// finite value; returns the super-group's. kWidth = 0: nothing received.
template <int kWidth, typename SrcT>
HWY_INLINE int32_t LoadValues(const SimdLevelTable* t, const uint8_t* received, const SgInput& in, float* tile,
                              float* group_max) {
  const DF df;
  const DI di;
  const DU du;
  const SrcT* src = static_cast<const SrcT*>(in.data);
  const VF subtract = hn::Set(df, in.subtract);
  constexpr int W = kWidth == 0 ? 2 : kWidth;  // unused without a received super-group
  constexpr int kGroupBytes = 2 * W + 1;
  const CodeUnpacker<W> unpack;
  const LevelDecoder<W> levels(t->base);
  const float unit = kWidth == 0 ? 0.0f : Bf16ToFloat(LoadSuperUnit(received, W, kSuperGroupSize));
#if DQ_AVX3
  VI maxima[kGroupsPerSuperGroup];
#else
  VI sg_max = hn::Zero(di);
#endif
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    VI m = hn::Zero(di);
    for (int v = 0; v < kVectorsPerGroup; ++v) {
      const int k = g * kGroupSize + v * kLanes;
      VF x;
      if constexpr (sizeof(SrcT) == 2) {  // bf16: the upper half of a float
        x = hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(hn::Rebind<uint16_t, DU>(), src + k))));
      } else {
        x = hn::LoadU(df, src + k);
      }
      x = hn::Sub(x, subtract);
      if constexpr (kWidth != 0) {
        const uint8_t* group = received + g * kGroupBytes;
        const VF scale = hn::Set(df, static_cast<float>(group[2 * W]) * unit);
        x = hn::Add(x, hn::Mul(levels.Levels(unpack.Codes(group, v, g == kGroupsPerSuperGroup - 1)), scale));
      }
      hn::Store(x, df, tile + k);
      m = hn::Max(m, hn::BitCast(di, hn::Abs(x)));
    }
#if DQ_AVX3
    maxima[kSlot[g]] = m;
#else
    m = hn::MaxOfLanes(di, m);
    sg_max = hn::Max(sg_max, m);
    group_max[g] = BitsToFloat(static_cast<uint32_t>(hn::GetLane(m)));
#endif
  }
#if DQ_AVX3
  const VI each = MaxOfEach(maxima);
  hn::StoreU(hn::BitCast(df, each), df, group_max);
  return hn::GetLane(hn::MaxOfLanes(di, each));
#else
  return hn::GetLane(sg_max);
#endif
}

// Pass 2: quantizes the tile (group maxima from pass 1) into `sg`.
template <int W, Search kSearch>
HWY_INLINE void QuantizeTile(const SimdLevelTable& st, const float* tile, const float* inverse,
                             const int32_t* scale_code, const SgRounding& rnd, uint8_t* sg) {
  const DF df;
  const DU du;
  constexpr int kGroupBytes = 2 * W + 1;
  const Quantizer<W, kSearch> quantizer(st, rnd);
  VU hash = hn::Add(hn::Mul(hn::Iota(du, 0), hn::Set(du, kIndexMultiplier)),
                    hn::Set(du, rnd.first_index * kIndexMultiplier + rnd.key));
  const VU hash_step = hn::Set(du, kLanes * kIndexMultiplier);
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    uint8_t* group = sg + g * kGroupBytes;
    const VF inv = hn::Set(df, inverse[g]);
    uint64_t words[2] = {0, 0};
    for (int v = 0; v < kVectorsPerGroup; ++v) {
      const VI code = quantizer.Codes(hn::Load(df, tile + g * kGroupSize + v * kLanes), inv, hash);
      hash = hn::Add(hash, hash_step);
      if constexpr (W == 8) {
        hn::StoreU(hn::Vec128<uint8_t, kLanes>{CodeBytes(code)}, hn::Simd<uint8_t, kLanes, 0>(), group + v * kLanes);
      } else {
#if DQ_AVX3
        StoreGroup<W>(PackGroup<W>(code), group, g == kGroupsPerSuperGroup - 1);
#else
        PackCodes<W>(code, v * kLanes, words);
#endif
      }
    }
    if constexpr (W != 8 && !DQ_AVX3) {
      memcpy(group, &words[0], W);
      memcpy(group + W, &words[1], W);
    }
    group[2 * W] = static_cast<uint8_t>(scale_code[g]);
  }
}

// Encodes the tile from pass 1 into `sg`, as EncodeSuperGroup.
template <int W>
HWY_NOINLINE void EncodeTile(const SimdLevelTable& st, const float* tile, const float* group_max, int32_t sg_max_bits,
                             const SgRounding& rnd, uint8_t* sg) {
  const DF df;
  const DI di;
  constexpr int kGroupBytes = 2 * W + 1;
  const bool finite = sg_max_bits < 0x7f800000;
  const uint16_t unit_bits = SuperUnitFor(BitsToFloat(static_cast<uint32_t>(sg_max_bits)), finite);
  // Written last: group stores may run over it (StoreGroup).
  auto store_unit = [&] {
    uint8_t* tail = sg + kGroupsPerSuperGroup * kGroupBytes;
    tail[0] = static_cast<uint8_t>(unit_bits);
    tail[1] = static_cast<uint8_t>(unit_bits >> 8);
  };
  if (!finite) {  // zero codes, scale 1; the NaN super unit marks the super-group
    uint8_t group[kGroupBytes] = {};
    for (int k = 0; k < kGroupSize; ++k) PackCode(group, k, W, static_cast<uint32_t>(st.base.max_level));
    group[2 * W] = 1;
    for (int g = 0; g < kGroupsPerSuperGroup; ++g) memcpy(sg + g * kGroupBytes, group, kGroupBytes);
    store_unit();
    return;
  }
  // Group scales and their inverses for all groups at once, as GroupScaleCode() and
  // InverseScale(): the scalar divisions would otherwise sit on every group's critical path.
  const float unit = Bf16ToFloat(unit_bits);
  HWY_ALIGN float inverse[kGroupsPerSuperGroup];
  HWY_ALIGN int32_t scale_code[kGroupsPerSuperGroup];
  const VF vunit = hn::Set(df, unit);
  const VF lo = hn::Set(df, 1.0f), hi = hn::Set(df, 255.0f);
  for (int g = 0; g < kGroupsPerSuperGroup; g += kLanes) {
    const VF gm = hn::LoadU(df, group_max + g);
    VF r = hn::Min(hn::Max(hn::Ceil(hn::Div(gm, vunit)), lo), hi);
    r = hn::IfThenElse(hn::And(hn::Lt(hn::Mul(r, vunit), gm), hn::Lt(r, hi)), hn::Add(r, lo), r);
    if (!(unit > 0.0f)) r = lo;
    const VF s = hn::Mul(r, vunit);
    hn::Store(hn::IfThenElseZero(hn::Gt(s, hn::Zero(df)), hn::Div(lo, s)), df, inverse + g);
    hn::Store(hn::ConvertTo(di, r), di, scale_code + g);
  }
  const LevelTable& t = st.base;
  if (W == 2) {
    QuantizeTile<W, Search::kTwoBit>(st, tile, inverse, scale_code, rnd, sg);
  } else if (t.uniform) {
    QuantizeTile<W, Search::kUniform>(st, tile, inverse, scale_code, rnd, sg);
  } else if (W <= 6) {
    QuantizeTile<W, Search::kBucket>(st, tile, inverse, scale_code, rnd, sg);
  } else {
    QuantizeTile<W, Search::kGather>(st, tile, inverse, scale_code, rnd, sg);
  }
  store_unit();
}

void EncodeTileForWidth(const SimdLevelTable& t, const float* tile, const float* group_max, int32_t sg_max_bits,
                        const SgRounding& rnd, uint8_t* sg) {
  switch (t.base.bits) {
    case 2:
      return EncodeTile<2>(t, tile, group_max, sg_max_bits, rnd, sg);
    case 3:
      return EncodeTile<3>(t, tile, group_max, sg_max_bits, rnd, sg);
    case 4:
      return EncodeTile<4>(t, tile, group_max, sg_max_bits, rnd, sg);
    case 5:
      return EncodeTile<5>(t, tile, group_max, sg_max_bits, rnd, sg);
    case 6:
      return EncodeTile<6>(t, tile, group_max, sg_max_bits, rnd, sg);
    case 7:
      return EncodeTile<7>(t, tile, group_max, sg_max_bits, rnd, sg);
    default:
      return EncodeTile<8>(t, tile, group_max, sg_max_bits, rnd, sg);
  }
}

void CompressSg(const SimdLevelTable& t, const SgInput& in, const SgRounding& rnd, uint8_t* sg) {
  HWY_ALIGN float tile[kSuperGroupSize];
  HWY_ALIGN float group_max[kGroupsPerSuperGroup];
  const int32_t sg_max = in.bf16 ? LoadValues<0, uint16_t>(&t, nullptr, in, tile, group_max)
                                 : LoadValues<0, float>(&t, nullptr, in, tile, group_max);
  EncodeTileForWidth(t, tile, group_max, sg_max, rnd, sg);
}

template <int W>
HWY_NOINLINE void DarImpl(const SimdLevelTable& t, const uint8_t* received, const SgInput& in, const SgRounding& rnd,
                          uint8_t* sg) {
  HWY_ALIGN float tile[kSuperGroupSize];
  HWY_ALIGN float group_max[kGroupsPerSuperGroup];
  const int32_t sg_max = in.bf16 ? LoadValues<W, uint16_t>(&t, received, in, tile, group_max)
                                 : LoadValues<W, float>(&t, received, in, tile, group_max);
  EncodeTile<W>(t, tile, group_max, sg_max, rnd, sg);
}

void DarSg(const SimdLevelTable& t, const uint8_t* received, const SgInput& in, const SgRounding& rnd, uint8_t* sg) {
  switch (t.base.bits) {
    case 2:
      return DarImpl<2>(t, received, in, rnd, sg);
    case 3:
      return DarImpl<3>(t, received, in, rnd, sg);
    case 4:
      return DarImpl<4>(t, received, in, rnd, sg);
    case 5:
      return DarImpl<5>(t, received, in, rnd, sg);
    case 6:
      return DarImpl<6>(t, received, in, rnd, sg);
    case 7:
      return DarImpl<7>(t, received, in, rnd, sg);
    default:
      return DarImpl<8>(t, received, in, rnd, sg);
  }
}

template <int W>
HWY_NOINLINE bool ValidateImpl(const SimdLevelTable& t, const uint8_t* sg) {
  const DI di;
  constexpr int kGroupBytes = 2 * W + 1;
  const uint16_t unit = LoadSuperUnit(sg, W, kSuperGroupSize);
  if (unit != kNanSuperUnit && (!IsFiniteFloat(Bf16ToFloat(unit)) || (unit & 0x8000u))) return false;
  const CodeUnpacker<W> unpack;
  // The one illegal code, 2^W - 1, is the largest a W-bit field holds: track the maximum.
  VI max_code = hn::Zero(di);
  uint8_t min_scale = 255;
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    const uint8_t* group = sg + g * kGroupBytes;
    min_scale = group[2 * W] < min_scale ? group[2 * W] : min_scale;
    for (int v = 0; v < kVectorsPerGroup; ++v) {
      max_code = hn::Max(max_code, unpack.Codes(group, v, g == kGroupsPerSuperGroup - 1));
    }
  }
  return min_scale != 0 && hn::AllFalse(di, hn::Eq(max_code, hn::Set(di, (1 << W) - 1)));
}

bool ValidateSg(const SimdLevelTable& t, const uint8_t* sg) {
  switch (t.base.bits) {
    case 2:
      return ValidateImpl<2>(t, sg);
    case 3:
      return ValidateImpl<3>(t, sg);
    case 4:
      return ValidateImpl<4>(t, sg);
    case 5:
      return ValidateImpl<5>(t, sg);
    case 6:
      return ValidateImpl<6>(t, sg);
    case 7:
      return ValidateImpl<7>(t, sg);
    default:
      return ValidateImpl<8>(t, sg);
  }
}

// What a decode does with each decoded value.
enum class Out { kStore, kAccumulate, kAddOffset };  // out = v, out += v, out = v + offset

template <int W, Out kOut>
HWY_NOINLINE void DecodeImpl(const SimdLevelTable& t, const uint8_t* sg, float offset, float* out) {
  const DF df;
  constexpr int kGroupBytes = 2 * W + 1;
  const CodeUnpacker<W> unpack;
  const LevelDecoder<W> levels(t.base);
  const float unit = Bf16ToFloat(LoadSuperUnit(sg, W, kSuperGroupSize));
  const VF voffset = hn::Set(df, offset);
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    const uint8_t* group = sg + g * kGroupBytes;
    const VF scale = hn::Set(df, static_cast<float>(group[2 * W]) * unit);
    for (int v = 0; v < kVectorsPerGroup; ++v) {
      VF value = hn::Mul(levels.Levels(unpack.Codes(group, v, g == kGroupsPerSuperGroup - 1)), scale);
      float* o = out + g * kGroupSize + v * kLanes;
      if constexpr (kOut == Out::kAccumulate) value = hn::Add(hn::LoadU(df, o), value);
      if constexpr (kOut == Out::kAddOffset) value = hn::Add(value, voffset);
      hn::StoreU(value, df, o);
    }
  }
}

template <Out kOut>
void DecodeDispatch(const SimdLevelTable& t, const uint8_t* sg, float offset, float* out) {
  switch (t.base.bits) {
    case 2:
      return DecodeImpl<2, kOut>(t, sg, offset, out);
    case 3:
      return DecodeImpl<3, kOut>(t, sg, offset, out);
    case 4:
      return DecodeImpl<4, kOut>(t, sg, offset, out);
    case 5:
      return DecodeImpl<5, kOut>(t, sg, offset, out);
    case 6:
      return DecodeImpl<6, kOut>(t, sg, offset, out);
    case 7:
      return DecodeImpl<7, kOut>(t, sg, offset, out);
    default:
      return DecodeImpl<8, kOut>(t, sg, offset, out);
  }
}

void DecodeSg(const SimdLevelTable& t, const uint8_t* sg, float* out) { DecodeDispatch<Out::kStore>(t, sg, 0, out); }
void DecodeAddSg(const SimdLevelTable& t, const uint8_t* sg, float* inout) {
  DecodeDispatch<Out::kAccumulate>(t, sg, 0, inout);
}
void DecodeOffsetSg(const SimdLevelTable& t, const uint8_t* sg, float offset, float* out) {
  DecodeDispatch<Out::kAddOffset>(t, sg, offset, out);
}

#endif  // !HWY_ARCH_X86 || HWY_TARGET > HWY_SSSE3

// Statistics of G consecutive full super-groups side by side (the dependent adds of one overlap
// the others'): SuperGroupMoments' kMomentLanes lane sums as vectors of N doubles each.
template <size_t G>
HWY_INLINE void MomentsOf(const float* v, float* stats) {
#if HWY_HAVE_SCALABLE  // sizeless vectors cannot be array elements
  for (size_t g = 0; g < G; ++g) {
    double sum = 0, sum_sq = 0;
    SuperGroupMoments(v + g * kSuperGroupSize, kSuperGroupSize, &sum, &sum_sq);
    SuperGroupStats(sum, sum_sq, kSuperGroupSize, stats + 2 * g);
  }
#else
  const hn::CappedTag<double, kMomentLanes> dd;
  const hn::Rebind<float, decltype(dd)> df;
  constexpr size_t N = HWY_MIN(HWY_LANES(double), static_cast<size_t>(kMomentLanes));
  constexpr size_t V = kMomentLanes / N;
  static_assert(V * N == kMomentLanes, "lanes must tile kMomentLanes");
  hn::Vec<decltype(dd)> s[G][V], q[G][V];
  for (size_t g = 0; g < G; ++g) {
    for (size_t u = 0; u < V; ++u) s[g][u] = q[g][u] = hn::Zero(dd);
  }
  for (size_t k = 0; k < kSuperGroupSize; k += kMomentLanes) {
    for (size_t g = 0; g < G; ++g) {
      for (size_t u = 0; u < V; ++u) {
        const auto x = hn::PromoteTo(dd, hn::LoadU(df, v + g * kSuperGroupSize + k + u * N));
        s[g][u] = hn::Add(s[g][u], x);
        q[g][u] = hn::MulAdd(x, x, q[g][u]);  // x * x is exact in double: fused or not, the same sum
      }
    }
  }
  for (size_t g = 0; g < G; ++g) {
    HWY_ALIGN double sums[kMomentLanes], squares[kMomentLanes];
    for (size_t u = 0; u < V; ++u) {
      hn::Store(s[g][u], dd, sums + u * N);
      hn::Store(q[g][u], dd, squares + u * N);
    }
    SuperGroupStats(SumMomentLanes(sums), SumMomentLanes(squares), kSuperGroupSize, stats + 2 * g);
  }
#endif
}

void StatsSgs(const float* values, size_t num_sgs, float* stats) {
  // 16 accumulators where a vector holds all kMomentLanes doubles (AVX3, 32 registers): 64 MiB in
  // 2.1 ms instead of 3.2 ms with 4 (dynamiq-kernels-bench stats); otherwise 4 (AVX2: 8 is slower).
  constexpr size_t kInterleave = HWY_LANES(double) >= static_cast<size_t>(kMomentLanes) ? 8 : 4;
  size_t j = 0;
  for (; j + kInterleave <= num_sgs; j += kInterleave) {
    MomentsOf<kInterleave>(values + j * kSuperGroupSize, stats + 2 * j);
  }
  for (; j + 4 <= num_sgs; j += 4) MomentsOf<4>(values + j * kSuperGroupSize, stats + 2 * j);
  for (; j < num_sgs; ++j) MomentsOf<1>(values + j * kSuperGroupSize, stats + 2 * j);
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace dynamiq::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace dynamiq::kernels {

HWY_EXPORT(CompressSg);
HWY_EXPORT(DarSg);
HWY_EXPORT(ValidateSg);
HWY_EXPORT(DecodeSg);
HWY_EXPORT(DecodeAddSg);
HWY_EXPORT(DecodeOffsetSg);
HWY_EXPORT(StatsSgs);
HWY_EXPORT(TargetName);

SimdLevelTable PrepareSimdTable(const LevelTable& t) {
  SimdLevelTable s;
  memset(&s, 0, sizeof(s));
  s.base = t;
  const int L = t.max_level;
  for (int r = 0; r < 64; ++r) s.above[r] = r < L - 1 ? t.level[r + 1] : HUGE_VALF;
  if (!t.uniform && t.bits >= 3 && t.bits <= 6) {
    const int buckets = 1 << t.bits;
    for (int i = 0; i < buckets; ++i) {
      // i / buckets is exact in float, as is the kernels' x * buckets.
      const float start = static_cast<float>(i) / static_cast<float>(buckets);
      const float end = static_cast<float>(i + 1) / static_cast<float>(buckets);
      int r = 0;
      while (r < L - 1 && t.level[r + 1] <= start) ++r;
      s.bucket[i] = r;
      // Levels a value in [start, end) (the last bucket: [start, 1]) may lie at or above.
      int steps = 0;
      for (int j = r + 1; j <= L - 1; ++j) steps += (t.level[j] < end || i == buckets - 1) ? 1 : 0;
      s.corrections = steps > s.corrections ? steps : s.corrections;
    }
  }
  return s;
}

void ComputeStatsSimd(const float* values, size_t num_sgs, float* stats) {
  HWY_DYNAMIC_DISPATCH(StatsSgs)(values, num_sgs, stats);
}
void CompressSuperGroupSimd(const SimdLevelTable& t, const SgInput& in, const SgRounding& rounding, uint8_t* sg) {
  HWY_DYNAMIC_DISPATCH(CompressSg)(t, in, rounding, sg);
}
void DecodeAddEncodeSuperGroupSimd(const SimdLevelTable& t, const uint8_t* received, const SgInput& in,
                                   const SgRounding& rounding, uint8_t* sg) {
  HWY_DYNAMIC_DISPATCH(DarSg)(t, received, in, rounding, sg);
}
bool ValidateSuperGroupSimd(const SimdLevelTable& t, const uint8_t* sg) {
  return HWY_DYNAMIC_DISPATCH(ValidateSg)(t, sg);
}
void DecodeSuperGroupSimd(const SimdLevelTable& t, const uint8_t* sg, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeSg)(t, sg, out);
}
void DecodeAddSuperGroupSimd(const SimdLevelTable& t, const uint8_t* sg, float* inout) {
  HWY_DYNAMIC_DISPATCH(DecodeAddSg)(t, sg, inout);
}
void DecodeOffsetSuperGroupSimd(const SimdLevelTable& t, const uint8_t* sg, float offset, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeOffsetSg)(t, sg, offset, out);
}

void EncodeSuperGroupSimd(const LevelTable& t, const float* v, uint32_t key, uint32_t first_index, bool correlated,
                          uint32_t stratum, uint32_t n, uint8_t* sg) {
  // v - 0.0f == v for every v the encoder can tell apart (NaN payloads do not matter).
  CompressSuperGroupSimd(PrepareSimdTable(t), SgInput{v, false, 0.0f},
                         SgRounding{key, first_index, correlated, stratum, n}, sg);
}
void DecodeSuperGroupSimd(const LevelTable& t, const uint8_t* sg, float* out) {
  DecodeSuperGroupSimd(PrepareSimdTable(t), sg, out);
}
void DecodeAddSuperGroupSimd(const LevelTable& t, const uint8_t* sg, float* inout) {
  DecodeAddSuperGroupSimd(PrepareSimdTable(t), sg, inout);
}
const char* DynamiqSimdTarget() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace dynamiq::kernels
#endif  // HWY_ONCE
