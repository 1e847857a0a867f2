// Highway implementation of kernels/cpu/dynamiq_simd.h. Compiled once per SIMD target by
// foreach_target.h; HWY_DYNAMIC_DISPATCH picks the best target for the running CPU.
//
// Every arithmetic step mirrors kernels/dynamiq_math.h operation for operation (same operands,
// same order, no fused multiply-add), so results are bit-identical to the scalar reference.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/dynamiq_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"
#include "kernels/cpu/dynamiq_simd.h"
#include "kernels/dynamiq_math.h"

HWY_BEFORE_NAMESPACE();
namespace dynamiq::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// At most one group (16 floats) per vector, so group reductions never cross groups.
using DF = hn::CappedTag<float, kGroupSize>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;

template <class V>
HWY_INLINE V Mix32Simd(V x) {
  const DU du;
  x = hn::Xor(x, hn::ShiftRight<16>(x));
  x = hn::Mul(x, hn::Set(du, 0x7feb352du));
  x = hn::Xor(x, hn::ShiftRight<15>(x));
  x = hn::Mul(x, hn::Set(du, 0x846ca68bu));
  x = hn::Xor(x, hn::ShiftRight<16>(x));
  return x;
}

// Unpacks the 16 codes of a group into int32 lanes.
HWY_INLINE void UnpackGroup(const uint8_t* codes, int bits, int32_t* out) {
  if (bits == 8) {
    for (int k = 0; k < kGroupSize; ++k) out[k] = codes[k];
  } else if (bits == 4) {
    uint64_t w;
    memcpy(&w, codes, 8);
    for (int k = 0; k < kGroupSize; ++k) out[k] = static_cast<int32_t>((w >> (4 * k)) & 15u);
  } else {
    uint32_t w;
    memcpy(&w, codes, 4);
    for (int k = 0; k < kGroupSize; ++k) out[k] = static_cast<int32_t>((w >> (2 * k)) & 3u);
  }
}

HWY_INLINE void PackGroup(const int32_t* in, int bits, uint8_t* codes) {
  if (bits == 8) {
    for (int k = 0; k < kGroupSize; ++k) codes[k] = static_cast<uint8_t>(in[k]);
  } else if (bits == 4) {
    uint64_t w = 0;
    for (int k = 0; k < kGroupSize; ++k) w |= static_cast<uint64_t>(in[k]) << (4 * k);
    memcpy(codes, &w, 8);
  } else {
    uint32_t w = 0;
    for (int k = 0; k < kGroupSize; ++k) w |= static_cast<uint32_t>(in[k]) << (2 * k);
    memcpy(codes, &w, 4);
  }
}

template <bool kAdd>
HWY_INLINE void DecodeImpl(const LevelTable& t, const uint8_t* sg, float* out) {
  const DF df;
  const DI di;
  const int N = static_cast<int>(hn::Lanes(df));
  const int bits = t.bits;
  const int group_bytes = 2 * bits + 1;
  const float unit = Bf16ToFloat(LoadSuperUnit(sg, bits, kSuperGroupSize));
  HWY_ALIGN int32_t codes[kGroupSize];
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    const uint8_t* group = sg + g * group_bytes;
    UnpackGroup(group, bits, codes);
    const auto scale = hn::Set(df, static_cast<float>(group[2 * bits]) * unit);
    for (int k = 0; k < kGroupSize; k += N) {
      auto value = hn::Mul(hn::GatherIndex(df, t.decode, hn::Load(di, codes + k)), scale);
      float* o = out + g * kGroupSize + k;
      if (kAdd) value = hn::Add(hn::LoadU(df, o), value);
      hn::StoreU(value, df, o);
    }
  }
}

void DecodeSg(const LevelTable& t, const uint8_t* sg, float* out) { DecodeImpl<false>(t, sg, out); }
void DecodeAddSg(const LevelTable& t, const uint8_t* sg, float* inout) { DecodeImpl<true>(t, sg, inout); }

void EncodeSg(const LevelTable& t, const float* v, uint32_t key, uint32_t first_index, bool correlated,
              uint32_t stratum, uint32_t n, uint8_t* sg) {
  const DF df;
  const DI di;
  const DU du;
  const int N = static_cast<int>(hn::Lanes(df));
  const int bits = t.bits;
  const int L = t.max_level;
  const int group_bytes = 2 * bits + 1;

  // Pass 1: group maxima, and whether the super-group is finite.
  float group_max[kGroupsPerSuperGroup];
  const auto kMaxFinite = hn::Set(df, 3.40282347e38f);
  auto all_finite = hn::Set(df, 0.0f) == hn::Set(df, 0.0f);
  float sg_max = 0.0f;
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    auto m = hn::Zero(df);
    for (int k = 0; k < kGroupSize; k += N) {
      const auto a = hn::Abs(hn::LoadU(df, v + g * kGroupSize + k));
      all_finite = hn::And(all_finite, a <= kMaxFinite);
      m = hn::Max(m, a);
    }
    group_max[g] = hn::GetLane(hn::MaxOfLanes(df, m));
    sg_max = group_max[g] > sg_max ? group_max[g] : sg_max;
  }
  const bool finite = hn::AllTrue(df, all_finite);
  const uint16_t unit_bits = SuperUnitFor(sg_max, finite);
  const float unit = finite ? Bf16ToFloat(unit_bits) : 0.0f;

  // Pass 2: quantize group by group.
  const auto one = hn::Set(df, 1.0f);
  const auto buckets = hn::Set(df, static_cast<float>(kSearchBuckets));
  const auto last_bucket = hn::Set(di, kSearchBuckets - 1);
  const auto top_interval = hn::Set(di, L - 1);
  const auto vL = hn::Set(di, L);
  const auto inv_2_24 = hn::Set(df, 1.0f / 16777216.0f);
  const auto vstratum = hn::Set(df, static_cast<float>(stratum));
  const auto inv_n = hn::Set(df, 1.0f / static_cast<float>(n));
  const auto max_u = hn::Set(df, 0.99999994f);
  const auto golden = hn::Set(du, 0x9e3779b1u);
  const auto vkey = hn::Set(du, key);
  HWY_ALIGN int32_t codes[kGroupSize];
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    uint8_t* group = sg + g * group_bytes;
    const uint32_t r_g = GroupScaleCode(group_max[g], unit);
    group[2 * bits] = static_cast<uint8_t>(r_g);
    if (!finite) {
      for (int k = 0; k < kGroupSize; ++k) codes[k] = L;
      PackGroup(codes, bits, group);
      continue;
    }
    const auto inv = hn::Set(df, InverseScale(static_cast<float>(r_g) * unit));
    for (int k = 0; k < kGroupSize; k += N) {
      const auto x = hn::LoadU(df, v + g * kGroupSize + k);
      const auto a = hn::Min(hn::Mul(hn::Abs(x), inv), one);
      auto idx = hn::Min(hn::ConvertTo(di, hn::Mul(a, buckets)), last_bucket);
      auto r = hn::GatherIndex(di, t.search, idx);
      const auto next = hn::GatherIndex(df, t.level, hn::Add(r, hn::Set(di, 1)));
      const auto step = hn::And(hn::RebindMask(di, a >= next), r < top_interval);
      r = hn::IfThenElse(step, hn::Add(r, hn::Set(di, 1)), r);
      const auto p = hn::Mul(hn::Sub(a, hn::GatherIndex(df, t.level, r)), hn::GatherIndex(df, t.inv_gap, r));
      // Rounding threshold, as RoundingUnit().
      const auto index = hn::Add(hn::Set(du, first_index + static_cast<uint32_t>(g * kGroupSize + k)), hn::Iota(du, 0));
      const auto bits32 = Mix32Simd(hn::Add(hn::Mul(index, golden), vkey));
      auto u = hn::Mul(hn::ConvertTo(df, hn::BitCast(di, hn::ShiftRight<8>(bits32))), inv_2_24);
      if (correlated) u = hn::Min(hn::Mul(hn::Add(vstratum, u), inv_n), max_u);
      const auto q = hn::IfThenElse(hn::RebindMask(di, u < p), hn::Add(r, hn::Set(di, 1)), r);
      const auto code = hn::IfThenElse(hn::RebindMask(di, x < hn::Zero(df)), hn::Sub(vL, q), hn::Add(vL, q));
      hn::Store(code, di, codes + k);
    }
    PackGroup(codes, bits, group);
  }
  uint8_t* tail = sg + kGroupsPerSuperGroup * group_bytes;
  tail[0] = static_cast<uint8_t>(unit_bits);
  tail[1] = static_cast<uint8_t>(unit_bits >> 8);
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
