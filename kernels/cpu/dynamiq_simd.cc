// Highway implementation of kernels/cpu/dynamiq_simd.h. Compiled once per SIMD target by
// foreach_target.h; HWY_DYNAMIC_DISPATCH picks the best target for the running CPU.
//
// Every arithmetic step mirrors kernels/dynamiq_math.h operation for operation (same operands,
// same order, no fused multiply-add), so results are bit-identical to the scalar reference.
// Speed comes from avoiding memory gathers: 2-bit and uniform levels are located arithmetically,
// 4-bit MEE tables (<= 16 entries) live in registers, and packing is done in vector registers.
// Only 8-bit MEE levels (the paper's choice, selectable but not our default) use gathers.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/dynamiq_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"
#include "kernels/cpu/dynamiq_simd.h"
#include "kernels/dynamiq_math.h"

#include <math.h>

HWY_BEFORE_NAMESPACE();
namespace dynamiq::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// At most one group (16 floats) per vector, so group reductions never cross groups.
using DF = hn::CappedTag<float, kGroupSize>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;
using VU = hn::Vec<DU>;
constexpr int kRegisterEntries = 32;          // MEE tables up to 6-bit codes (L + 1 = 32 levels)
constexpr int kMaxPieces = kRegisterEntries;  // register tables in pieces of one vector (N >= 1 lanes)

HWY_INLINE VU Mix32Simd(VU x) {
  const DU du;
  x = hn::Xor(x, hn::ShiftRight<16>(x));
  x = hn::Mul(x, hn::Set(du, 0x7feb352du));
  x = hn::Xor(x, hn::ShiftRight<15>(x));
  x = hn::Mul(x, hn::Set(du, 0x846ca68bu));
  x = hn::Xor(x, hn::ShiftRight<16>(x));
  return x;
}

// A table of up to 16 floats held in registers, looked up with lane permutes.
struct RegisterTable {
  VF piece[kMaxPieces];
  int pieces = 0;

  // Holds table[0, entries) (entries <= kRegisterEntries; whole vectors are loaded).
  void Load(const float* table, int entries) {
    const DF df;
    const int N = static_cast<int>(hn::Lanes(df));
    pieces = (entries + N - 1) / N;
    for (int p = 0; p < pieces; ++p) piece[p] = hn::LoadU(df, table + p * N);
  }
  // table[idx] for 0 <= idx < pieces * N.
  HWY_INLINE VF Lookup(VI idx) const {
    const DF df;
    const DI di;
    const int N = static_cast<int>(hn::Lanes(df));
    const auto within = hn::And(idx, hn::Set(di, N - 1));
    VF out = hn::TableLookupLanes(piece[0], hn::IndicesFromVec(df, within));
    for (int p = 1; p < pieces; ++p) {
      const auto hit = hn::RebindMask(df, hn::Gt(idx, hn::Set(di, p * N - 1)));
      out = hn::IfThenElse(hit, hn::TableLookupLanes(piece[p], hn::IndicesFromVec(df, within)), out);
    }
    return out;
  }
};

// A group's 16 codes of width W occupy 2W bytes: codes 0..7 the first W (one little-endian word),
// codes 8..15 the next W. Packing through two 64-bit words with compile-time shifts is cheaper
// than byte-wise bit fiddling; 8-bit codes are plain bytes and use vector promote/demote.
// Per-lane shift amounts to pull code j (of a group) out of the 64-bit word of its half, split
// into the two 32-bit halves of that word. Computed once per super-group.
struct UnpackShifts {
  VU shift_lo, shift_hi;  // right shift of the low word; left (s < 32) or right shift of the high word
  hn::Mask<DU> from_lo, hi_left, hi_used, first_half;
};

template <int W>
HWY_INLINE UnpackShifts MakeUnpackShifts(int k0) {
  const DU du;
  const VU lane = hn::Add(hn::Set(du, static_cast<uint32_t>(k0)), hn::Iota(du, 0));
  const VU s = hn::Mul(hn::And(lane, hn::Set(du, 7)), hn::Set(du, W));  // bit offset in the 64-bit word
  UnpackShifts u;
  u.from_lo = hn::Lt(s, hn::Set(du, 32));
  u.hi_left = hn::And(u.from_lo, hn::Gt(hn::Add(s, hn::Set(du, W)), hn::Set(du, 32)));  // straddles
  u.hi_used = hn::Or(u.hi_left, hn::Not(u.from_lo));
  u.shift_lo = hn::And(s, hn::Set(du, 31));
  u.shift_hi =
      hn::And(hn::IfThenElse(u.from_lo, hn::Sub(hn::Set(du, 32), s), hn::Sub(s, hn::Set(du, 32))), hn::Set(du, 31));
  u.first_half = hn::Lt(lane, hn::Set(du, 8));
  return u;
}

// The two W-byte words of a group (codes 0..7 and 8..15) with fixed-size loads. Within a super-group
// at least 2W + 3 bytes follow a group's start (codes, scale byte, and at worst the super unit),
// so an 8-byte load never leaves it; the second load is moved back where needed and shifted.
template <int W>
HWY_INLINE void LoadHalves(const uint8_t* codes, uint64_t* half) {
  if constexpr (W == 2) {
    uint32_t w;
    memcpy(&w, codes, 4);
    half[0] = w & 0xffffu;
    half[1] = w >> 16;
  } else {
    constexpr int kAvailable = 2 * W + 3;
    constexpr int kOffset = W + 8 <= kAvailable ? W : kAvailable - 8;
    constexpr uint64_t kMask = W == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * W)) - 1;
    uint64_t a, b;
    memcpy(&a, codes, 8);
    memcpy(&b, codes + kOffset, 8);
    half[0] = a & kMask;
    half[1] = (b >> (8 * (W - kOffset))) & kMask;
  }
}

// Codes [k0, k0 + N) of a group of W-bit codes, in registers (no store-to-load round trip).
template <int W>
HWY_INLINE VI UnpackVector(const uint8_t* codes, const UnpackShifts& u) {
  const DU du;
  const DI di;
  uint64_t half[2];
  LoadHalves<W>(codes, half);
  const VU lo = hn::IfThenElse(u.first_half, hn::Set(du, static_cast<uint32_t>(half[0])),
                               hn::Set(du, static_cast<uint32_t>(half[1])));
  const VU hi = hn::IfThenElse(u.first_half, hn::Set(du, static_cast<uint32_t>(half[0] >> 32)),
                               hn::Set(du, static_cast<uint32_t>(half[1] >> 32)));
  const VU from_lo = hn::IfThenElseZero(u.from_lo, hn::Shr(lo, u.shift_lo));
  const VU from_hi =
      hn::IfThenElseZero(u.hi_used, hn::IfThenElse(u.hi_left, hn::Shl(hi, u.shift_hi), hn::Shr(hi, u.shift_hi)));
  return hn::BitCast(di, hn::And(hn::Or(from_lo, from_hi), hn::Set(du, (1u << W) - 1u)));
}

template <int W>
HWY_INLINE void PackGroup(const int32_t* in, uint8_t* codes) {
  for (int half = 0; half < 2; ++half) {
    uint64_t word = 0;
    for (int k = 0; k < 8; ++k) word |= static_cast<uint64_t>(in[half * 8 + k]) << (k * W);
    memcpy(codes + half * W, &word, W);
  }
}

#if HWY_TARGET != HWY_SCALAR
// ORs codes [k0, k0 + N) of a group into the two 64-bit words of the packed group: widen to 64-bit
// lanes, shift each code to its bit offset, and sum (the codes occupy disjoint bits).
template <int W>
HWY_INLINE void PackVector(VI code, int k0, uint64_t* words) {
  const DF df;
  const DU du;
  const hn::Half<DU> dh;
  const hn::Repartition<uint64_t, DU> d64;
  constexpr int kHalfLanes = static_cast<int>(hn::MaxLanes(DF())) / 2;
  const VU c = hn::BitCast(du, code);
  const hn::Vec<decltype(dh)> parts[2] = {hn::LowerHalf(dh, c), hn::UpperHalf(dh, c)};
  for (int p = 0; p < 2; ++p) {
    const int first = k0 + p * kHalfLanes;  // group lane of the part's first lane
    const auto lane = hn::Add(hn::Set(d64, static_cast<uint64_t>(first)), hn::Iota(d64, 0));
    const auto shift = hn::Mul(hn::And(lane, hn::Set(d64, 7)), hn::Set(d64, W));
    const auto wide = hn::Shl(hn::PromoteTo(d64, parts[p]), shift);
    words[first / 8] |= hn::GetLane(hn::SumOfLanes(d64, wide));
  }
  (void)df;
}
#endif  // HWY_TARGET != HWY_SCALAR

#if HWY_TARGET != HWY_SCALAR
// With 16 lanes (one whole group per vector): pack by merging neighbours in a tree, pairs within
// 64-bit lanes, then even/odd lanes twice, which leaves the two words in lanes 0 and 1. Shorter
// dependency chains than two horizontal sums.
template <int W>
HWY_INLINE void PackWholeGroup(VI code, uint8_t* codes) {
  const hn::Repartition<uint64_t, DU> d64;
  const auto x = hn::BitCast(d64, code);
  const auto pairs = hn::Or(hn::And(x, hn::Set(d64, 0xffffffffull)), hn::ShiftLeft<W>(hn::ShiftRight<32>(x)));
  const auto quads = hn::Or(hn::ConcatEven(d64, pairs, pairs), hn::ShiftLeft<2 * W>(hn::ConcatOdd(d64, pairs, pairs)));
  const auto words = hn::Or(hn::ConcatEven(d64, quads, quads), hn::ShiftLeft<4 * W>(hn::ConcatOdd(d64, quads, quads)));
  const uint64_t lo = hn::GetLane(words);
  const uint64_t hi = hn::GetLane(hn::ShiftRightLanes<1>(d64, words));
  memcpy(codes, &lo, W);
  memcpy(codes + W, &hi, W);
}
#endif  // HWY_TARGET != HWY_SCALAR

// How a table's levels are located and decoded.
enum class Path { kTwoBit, kUniform, kRegister, kGather };

Path PathFor(const LevelTable& t) {
  if (t.bits == 2) return Path::kTwoBit;
  if (t.uniform) return Path::kUniform;
  return t.max_level < kRegisterEntries ? Path::kRegister : Path::kGather;
}

template <int W, bool kAdd>
HWY_NOINLINE void DecodeImpl(const LevelTable& t, const uint8_t* sg, float* out) {
  const DF df;
  const DI di;
  const int N = static_cast<int>(hn::Lanes(df));
  constexpr int kGroupBytes = 2 * W + 1;
  const Path path = PathFor(t);
  RegisterTable levels;
  if (path == Path::kRegister) levels.Load(t.level, t.max_level + 1);
  const VI vL = hn::Set(di, t.max_level);
  const VF inv_L = hn::Set(df, t.level[1]);  // uniform: level[1] = 1 * (1/L) = 1/L exactly
  const float unit = Bf16ToFloat(LoadSuperUnit(sg, W, kSuperGroupSize));
  UnpackShifts shifts[kGroupSize];
  for (int k = 0; k < kGroupSize; k += N) shifts[k] = MakeUnpackShifts<W>(k);
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    const uint8_t* group = sg + g * kGroupBytes;
    const VF scale = hn::Set(df, static_cast<float>(group[2 * W]) * unit);
    for (int k = 0; k < kGroupSize; k += N) {
      const VI code = W == 8 ? hn::PromoteTo(di, hn::LoadU(hn::Rebind<uint8_t, DI>(), group + k))
                             : UnpackVector<W>(group, shifts[k]);
      VF level;
      if (path == Path::kRegister) {  // sign * level[|q|], as the decode table holds it
        const VI q = hn::Sub(code, vL);
        const VF magnitude = levels.Lookup(hn::Abs(q));
        level = hn::IfThenElse(hn::RebindMask(df, hn::Lt(q, hn::Zero(di))), hn::Neg(magnitude), magnitude);
      } else if (path == Path::kGather) {
        level = hn::GatherIndex(df, t.decode, code);
      } else {
        level = hn::Mul(hn::ConvertTo(df, hn::Sub(code, vL)), inv_L);
      }
      VF value = hn::Mul(level, scale);
      float* o = out + g * kGroupSize + k;
      if (kAdd) value = hn::Add(hn::LoadU(df, o), value);
      hn::StoreU(value, df, o);
    }
  }
}

template <bool kAdd>
void DecodeDispatch(const LevelTable& t, const uint8_t* sg, float* out) {
  switch (t.bits) {
    case 2:
      return DecodeImpl<2, kAdd>(t, sg, out);
    case 3:
      return DecodeImpl<3, kAdd>(t, sg, out);
    case 4:
      return DecodeImpl<4, kAdd>(t, sg, out);
    case 5:
      return DecodeImpl<5, kAdd>(t, sg, out);
    case 6:
      return DecodeImpl<6, kAdd>(t, sg, out);
    case 7:
      return DecodeImpl<7, kAdd>(t, sg, out);
    default:
      return DecodeImpl<8, kAdd>(t, sg, out);
  }
}

void DecodeSg(const LevelTable& t, const uint8_t* sg, float* out) { DecodeDispatch<false>(t, sg, out); }
void DecodeAddSg(const LevelTable& t, const uint8_t* sg, float* inout) { DecodeDispatch<true>(t, sg, inout); }

template <int W>
HWY_NOINLINE void EncodeImpl(const LevelTable& t, const float* v, uint32_t key, uint32_t first_index, bool correlated,
                             uint32_t stratum, uint32_t n, uint8_t* sg) {
  const DF df;
  const DI di;
  const DU du;
  const int N = static_cast<int>(hn::Lanes(df));
  constexpr int bits = W;
  const int L = t.max_level;
  constexpr int group_bytes = 2 * W + 1;
  const Path path = PathFor(t);

  // Pass 1: group maxima, and whether the super-group is finite.
  HWY_ALIGN float group_max[kGroupsPerSuperGroup];
  const VF max_finite = hn::Set(df, 3.40282347e38f);
  auto all_finite = hn::Eq(hn::Zero(df), hn::Zero(df));
  float sg_max = 0.0f;
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    VF m = hn::Zero(df);
    for (int k = 0; k < kGroupSize; k += N) {
      const VF a = hn::Abs(hn::LoadU(df, v + g * kGroupSize + k));
      all_finite = hn::And(all_finite, hn::Le(a, max_finite));
      m = hn::Max(m, a);
    }
    group_max[g] = hn::GetLane(hn::MaxOfLanes(df, m));
    sg_max = group_max[g] > sg_max ? group_max[g] : sg_max;
  }
  const bool finite = hn::AllTrue(df, all_finite);
  const uint16_t unit_bits = SuperUnitFor(sg_max, finite);
  const float unit = finite ? Bf16ToFloat(unit_bits) : 0.0f;

  // Pass 2: quantize group by group.
  // Register path: level[] and inv_gap[] for the interval, and level[] padded with +inf above L - 1
  // for the binary search of the interval (largest r <= L - 1 with level[r] <= a).
  RegisterTable level_table, inv_gap_table, search_table;
  int search_step = 1;
  if (path == Path::kRegister) {
    const int entries = t.max_level + 1;
    level_table.Load(t.level, entries);
    inv_gap_table.Load(t.inv_gap, entries);
    HWY_ALIGN float search[kRegisterEntries];
    for (int j = 0; j < kRegisterEntries; ++j) search[j] = j < t.max_level ? t.level[j] : HUGE_VALF;
    search_table.Load(search, entries);
    while (search_step * 2 < entries) search_step *= 2;
  }
  const VF one = hn::Set(df, 1.0f);
  const VF inv_L = hn::Set(df, t.level[1]);
  const VF top_level = hn::Set(df, t.level[L]);
  const VF fL = hn::Set(df, static_cast<float>(L));
  const VI vL = hn::Set(di, L);
  const VI top_interval = hn::Set(di, L - 1);
  const VI int_one = hn::Set(di, 1);
  const VF buckets = hn::Set(df, static_cast<float>(kSearchBuckets));
  const VI last_bucket = hn::Set(di, kSearchBuckets - 1);
  const VF inv_2_24 = hn::Set(df, 1.0f / 16777216.0f);
  const VF vstratum = hn::Set(df, static_cast<float>(stratum));
  const VF inv_n = hn::Set(df, 1.0f / static_cast<float>(n));
  const VF max_u = hn::Set(df, 0.99999994f);
  const VU golden = hn::Set(du, 0x9e3779b1u);
  const VU vkey = hn::Set(du, key);
  // Codes of the N elements at src (bucket indices index0...), as QuantizeElement().
  auto QuantizeVector = [&](const float* src, VF inv, uint32_t index0) -> VI {
    const VF x = hn::LoadU(df, src);
    const VF a = hn::Min(hn::Mul(hn::Abs(x), inv), one);
    VI r;
    VF p;
    if (path == Path::kTwoBit) {
      r = hn::Zero(di);
      p = a;  // level[0] = 0, inv_gap[0] = 1
    } else if (path == Path::kUniform) {
      r = hn::Min(hn::ConvertTo(di, hn::Mul(a, fL)), top_interval);
      const auto down = hn::RebindMask(di, hn::Lt(a, hn::Mul(hn::ConvertTo(df, r), inv_L)));
      const auto up = hn::And(hn::RebindMask(di, hn::Ge(a, hn::Mul(hn::ConvertTo(df, hn::Add(r, int_one)), inv_L))),
                              hn::Lt(r, top_interval));
      r = hn::IfThenElse(down, hn::Sub(r, int_one), hn::IfThenElse(up, hn::Add(r, int_one), r));
      p = hn::Mul(hn::Sub(a, hn::Mul(hn::ConvertTo(df, r), inv_L)), fL);
    } else if (path == Path::kRegister) {
      r = hn::Zero(di);
      for (int step = search_step; step >= 1; step /= 2) {
        const VI candidate = hn::Add(r, hn::Set(di, step));
        r = hn::IfThenElse(hn::RebindMask(di, hn::Ge(a, search_table.Lookup(candidate))), candidate, r);
      }
      p = hn::Mul(hn::Sub(a, level_table.Lookup(r)), inv_gap_table.Lookup(r));
    } else {
      const VI idx = hn::Min(hn::ConvertTo(di, hn::Mul(a, buckets)), last_bucket);
      r = hn::GatherIndex(di, t.search, idx);
      const VF next = hn::GatherIndex(df, t.level, hn::Add(r, int_one));
      r = hn::IfThenElse(hn::And(hn::RebindMask(di, hn::Ge(a, next)), hn::Lt(r, top_interval)), hn::Add(r, int_one), r);
      p = hn::Mul(hn::Sub(a, hn::GatherIndex(df, t.level, r)), hn::GatherIndex(df, t.inv_gap, r));
    }
    // Rounding threshold, as RoundingUnit().
    const VU index = hn::Add(hn::Set(du, index0), hn::Iota(du, 0));
    const VU bits32 = Mix32Simd(hn::Add(hn::Mul(index, golden), vkey));
    VF u = hn::Mul(hn::ConvertTo(df, hn::BitCast(di, hn::ShiftRight<8>(bits32))), inv_2_24);
    if (correlated) u = hn::Min(hn::Mul(hn::Add(vstratum, u), inv_n), max_u);
    const auto round_up = hn::Or(hn::Lt(u, p), hn::Ge(a, top_level));
    const VI q = hn::IfThenElse(hn::RebindMask(di, round_up), hn::Add(r, int_one), r);
    return hn::IfThenElse(hn::RebindMask(di, hn::Lt(x, hn::Zero(df))), hn::Sub(vL, q), hn::Add(vL, q));
  };
  // Group scales for all 16 groups at once, as GroupScaleCode() and InverseScale(): the scalar
  // divisions would otherwise sit on every group's critical path.
  HWY_ALIGN float inverse[kGroupsPerSuperGroup];
  HWY_ALIGN float scale_code[kGroupsPerSuperGroup];
  {
    const VF vunit = hn::Set(df, unit);
    const VF lo = hn::Set(df, 1.0f), hi = hn::Set(df, 255.0f);
    for (int g = 0; g < kGroupsPerSuperGroup; g += N) {
      const VF gm = hn::Load(df, group_max + g);
      VF r = hn::Min(hn::Max(hn::Ceil(hn::Div(gm, vunit)), lo), hi);
      r = hn::IfThenElse(hn::And(hn::Lt(hn::Mul(r, vunit), gm), hn::Lt(r, hi)), hn::Add(r, lo), r);
      if (!(unit > 0.0f)) r = lo;
      const VF s = hn::Mul(r, vunit);
      hn::Store(hn::IfThenElseZero(hn::Gt(s, hn::Zero(df)), hn::Div(lo, s)), df, inverse + g);
      hn::Store(r, df, scale_code + g);
    }
  }
  HWY_ALIGN int32_t staged[kGroupSize];
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    uint8_t* group = sg + g * group_bytes;
    group[2 * bits] = static_cast<uint8_t>(scale_code[g]);
    const VF inv = hn::Set(df, inverse[g]);
    uint64_t words[2] = {0, 0};
    for (int k = 0; k < kGroupSize; k += N) {
      // A non-finite super-group sends zero codes; its NaN super unit marks it.
      const VI code =
          finite ? QuantizeVector(v + g * kGroupSize + k, inv, first_index + static_cast<uint32_t>(g * kGroupSize + k))
                 : vL;
      if constexpr (W == 8) {
        hn::StoreU(hn::DemoteTo(hn::Rebind<uint8_t, DI>(), code), hn::Rebind<uint8_t, DI>(), group + k);
      } else if constexpr (hn::MaxLanes(DF()) == kGroupSize) {
        PackWholeGroup<W>(code, group);
      } else if constexpr (hn::MaxLanes(DF()) >= 2) {
        PackVector<W>(code, k, words);
      } else {
        hn::Store(code, di, staged + k);
      }
    }
    if constexpr (W != 8 && hn::MaxLanes(DF()) != kGroupSize) {
      if constexpr (hn::MaxLanes(DF()) >= 2) {
        memcpy(group, &words[0], W);
        memcpy(group + W, &words[1], W);
      } else {
        PackGroup<W>(staged, group);
      }
    }
  }
  uint8_t* tail = sg + kGroupsPerSuperGroup * group_bytes;
  tail[0] = static_cast<uint8_t>(unit_bits);
  tail[1] = static_cast<uint8_t>(unit_bits >> 8);
}

void EncodeSg(const LevelTable& t, const float* v, uint32_t key, uint32_t first_index, bool correlated,
              uint32_t stratum, uint32_t n, uint8_t* sg) {
  switch (t.bits) {
    case 2:
      return EncodeImpl<2>(t, v, key, first_index, correlated, stratum, n, sg);
    case 3:
      return EncodeImpl<3>(t, v, key, first_index, correlated, stratum, n, sg);
    case 4:
      return EncodeImpl<4>(t, v, key, first_index, correlated, stratum, n, sg);
    case 5:
      return EncodeImpl<5>(t, v, key, first_index, correlated, stratum, n, sg);
    case 6:
      return EncodeImpl<6>(t, v, key, first_index, correlated, stratum, n, sg);
    case 7:
      return EncodeImpl<7>(t, v, key, first_index, correlated, stratum, n, sg);
    default:
      return EncodeImpl<8>(t, v, key, first_index, correlated, stratum, n, sg);
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace dynamiq::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace dynamiq::kernels {

HWY_EXPORT(EncodeSg);
HWY_EXPORT(DecodeSg);
HWY_EXPORT(DecodeAddSg);
HWY_EXPORT(TargetName);

void EncodeSuperGroupSimd(const LevelTable& t, const float* v, uint32_t key, uint32_t first_index, bool correlated,
                          uint32_t stratum, uint32_t n, uint8_t* sg) {
  HWY_DYNAMIC_DISPATCH(EncodeSg)(t, v, key, first_index, correlated, stratum, n, sg);
}
void DecodeSuperGroupSimd(const LevelTable& t, const uint8_t* sg, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeSg)(t, sg, out);
}
void DecodeAddSuperGroupSimd(const LevelTable& t, const uint8_t* sg, float* inout) {
  HWY_DYNAMIC_DISPATCH(DecodeAddSg)(t, sg, inout);
}
const char* DynamiqSimdTarget() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace dynamiq::kernels
#endif  // HWY_ONCE
