// Parity checks of the DynamiQ CUDA kernels (kernels/cuda/launch.h) against the CPU codec,
// shared by the GPU test (dynamiq_cuda_test.cu) and the CPU emulation of the kernel bodies
// (dynamiq_cuda_emulation_test.cc). A KernelBackend runs the kernels on one chunk; CheckParity
// compares every operation with DynamiqCodec (scalar kernel), byte for byte and bit for bit.
#ifndef DQ_TESTS_KERNELS_DYNAMIQ_CUDA_PARITY_H_
#define DQ_TESTS_KERNELS_DYNAMIQ_CUDA_PARITY_H_

#include <stdint.h>
#include <string.h>

#include <cmath>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/cuda/dynamiq_cuda_host.h"
#include "kernels/cuda/launch.h"
#include "kernels/dynamiq_math.h"
#include "kernels/random_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels::parity {

// Runs the kernels on one chunk: host vectors in and out, device copies are the backend's
// business. `tables` holds kMaxWidth + 1 tables (CopyDynamiqLevelTables); `c.widths` and
// `c.offsets` are the per-super-group arrays to upload.
class KernelBackend {
 public:
  virtual ~KernelBackend() = default;
  virtual std::vector<uint8_t> Encode(const DynamiqCudaChunk& c, const LevelTable* tables,
                                      const std::vector<float>& values) = 0;
  // `out` is the initial content of the output buffer (what accumulate adds to).
  virtual std::vector<float> Decode(const DynamiqCudaChunk& c, const LevelTable* tables,
                                    const std::vector<uint8_t>& sgs, std::vector<float> out, bool accumulate) = 0;
  // in_place: the output buffer is the input buffer.
  virtual std::vector<uint8_t> Dar(const DynamiqCudaChunk& c, const LevelTable* tables,
                                   const std::vector<uint8_t>& in_sgs, const std::vector<float>& local,
                                   bool in_place) = 0;
  // The index DynamiqValidateCuda reports (-1: all valid).
  virtual int Validate(const DynamiqCudaChunk& c, const LevelTable* tables, const std::vector<uint8_t>& sgs) = 0;
};

struct CaseSpec {
  LevelKind levels = LevelKind::kMee;
  bool correlated = false;
  int width = 2;  // width of the chunk's first super-group; the others cycle through 2..8
  bool non_finite = false;
};

inline std::string CaseName(const CaseSpec& s) {
  return absl::StrCat(s.levels == LevelKind::kMee ? "Mee" : (s.levels == LevelKind::kUniform ? "Uniform" : "Auto"),
                      s.correlated ? "Correlated" : "Independent", "W", s.width, s.non_finite ? "NonFinite" : "Finite");
}

// gtest prints parameters with this (test names in ctest, failure messages).
inline void PrintTo(const CaseSpec& s, std::ostream* os) { *os << CaseName(s); }

inline std::vector<CaseSpec> AllCaseSpecs() {
  std::vector<CaseSpec> specs;
  for (LevelKind levels : {LevelKind::kMee, LevelKind::kUniform}) {
    for (bool correlated : {false, true}) {
      for (int width = kMinWidth; width <= kMaxWidth; ++width) {
        for (bool non_finite : {false, true}) specs.push_back({levels, correlated, width, non_finite});
      }
    }
  }
  return specs;
}

// The bucket: 13 full super-groups and one of 77 elements. The chunk under test covers
// super-groups 3..13 (so first_sg = 3 and the last super-group is partial); super-group 4 has
// width 0, the others cycle through all widths 2..8 starting at spec.width.
inline constexpr size_t kBucketElements = 13 * kSuperGroupSize + 77;
inline constexpr size_t kFirstSg = 3;
inline constexpr size_t kZeroSg = 4;

struct ParityCase {
  std::unique_ptr<DynamiqCodec> codec;
  BucketPlan plan;       // rank 0: compresses `local`, runs DAR on the peer's chunk
  BucketPlan peer_plan;  // rank 1: compresses `peer`
  ChunkRef chunk;
  std::vector<float> local;  // chunk.count values per rank
  std::vector<float> peer;
};

// Per-super-group magnitudes: zeros, denormals, tiny, ordinary, large, near overflow (the sum of
// two ranks' values may overflow to Inf in DAR, which must give the NaN marker on both sides).
inline float SgScale(size_t sg, int rank) {
  static constexpr float kScales[] = {1.0f, 1e-3f,  40.0f, 0.0f, 0.0f, 1e-39f, 5e37f,
                                      1.0f, 1e-20f, 7.5f,  3e5f, 1.0f, 0.5f,   2.0f};
  if (sg == kZeroSg) return 0.0f;
  return kScales[(sg + 2 * rank) % (sizeof(kScales) / sizeof(kScales[0]))];
}

inline std::vector<float> ChunkValues(const ChunkRef& chunk, int rank, bool non_finite) {
  std::vector<float> v(chunk.count);
  const uint32_t key = StreamKey(0x5eed + rank, 0, 0);
  for (size_t i = 0; i < chunk.count; ++i) {
    const size_t e = chunk.begin + i;
    const size_t sg = e / kSuperGroupSize;
    const double u1 = (RandomBits(key, 2 * e) + 0.5) / 4294967296.0;
    const double u2 = (RandomBits(key, 2 * e + 1) + 0.5) / 4294967296.0;
    float g = static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2));
    const size_t k = e % kSuperGroupSize;
    if (sg == 7 && k / kGroupSize == 2) g = 0.0f;          // an all-zero group inside a super-group
    if (sg == 7 && k == 5 * kGroupSize + 3) g *= 1000.0f;  // an outlier
    if (sg == 10 && k / kGroupSize == 4) g = 0.25f;        // a constant group
    v[i] = g * SgScale(sg, rank);
  }
  if (non_finite) {
    auto at = [&](size_t sg, size_t k) -> float& { return v[sg * kSuperGroupSize + k - chunk.begin]; };
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    if (rank == 0) {
      at(6, 17) = inf;
      at(8, 3) = nan;
      at(13, 76) = -inf;  // the last element of the partial super-group
    } else {
      at(9, 200) = nan;
      at(11, 0) = -inf;
    }
  }
  return v;
}

inline ParityCase MakeCase(const CaseSpec& spec) {
  ParityCase c;
  CodecConfig config;
  config.id = CodecId::kDynamiq;
  config.levels = spec.levels;
  config.correlated_rounding = spec.correlated;
  config.seed = 0x1234abcdull;
  c.codec = std::make_unique<DynamiqCodec>(config, DynamiqCodec::Kernel::kScalar);
  const size_t num_sg = (kBucketElements + kSuperGroupSize - 1) / kSuperGroupSize;
  c.plan.round = RoundInfo{7, 0, 2};
  c.plan.num_elements = kBucketElements;
  c.plan.widths.resize(num_sg);
  for (size_t j = 0; j < num_sg; ++j) {
    const int cycle = (spec.width - kMinWidth + 7 + static_cast<int>(j) - static_cast<int>(kFirstSg)) % 7;
    c.plan.widths[j] = j == kZeroSg ? 0 : static_cast<uint8_t>(kMinWidth + cycle);
  }
  c.peer_plan = c.plan;
  c.peer_plan.round.rank = 1;
  c.chunk.chunk_id = 2;
  c.chunk.begin = kFirstSg * kSuperGroupSize;
  c.chunk.count = kBucketElements - c.chunk.begin;
  c.chunk.rounding_index = 1;
  c.chunk.rounding_size = 3;
  c.chunk.rounding_group = 5;
  c.local = ChunkValues(c.chunk, 0, spec.non_finite);
  c.peer = ChunkValues(c.chunk, 1, spec.non_finite);
  return c;
}

inline Source Src(const std::vector<float>& v, const ChunkRef& chunk) {
  return Source{v.data(), DType::kFloat32, chunk.begin, nullptr};
}

// "" if equal, else where the first difference is.
inline std::string ByteMismatch(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                                const DynamiqCudaChunk& c) {
  if (got.size() != want.size()) return absl::StrCat("size ", got.size(), " != ", want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    size_t j = 0;
    while (j + 1 < c.offsets.size() && c.offsets[j + 1] <= i) ++j;
    return absl::StrCat("byte ", i, " (super-group ", j, " of the chunk, width ", c.widths[j], ", byte ",
                        i - c.offsets[j], " of it): got ", got[i], ", want ", want[i]);
  }
  return "";
}

// Bitwise, except that any NaN equals any NaN (GPUs produce the canonical NaN 0x7fffffff where
// x86 propagates the input's payload).
inline std::string FloatMismatch(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return absl::StrCat("size ", got.size(), " != ", want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      return absl::StrCat("element ", i, " (super-group ", i / kSuperGroupSize, " of the chunk): got ", got[i],
                          ", want ", want[i]);
    }
  }
  return "";
}

inline std::vector<uint8_t> CpuCompress(const ParityCase& pc, const BucketPlan& plan,
                                        const std::vector<float>& values) {
  std::vector<uint8_t> out(pc.codec->MaxEncodedBytes(plan, pc.chunk));
  auto n = pc.codec->Compress(plan, pc.chunk, Src(values, pc.chunk), absl::MakeSpan(out));
  EXPECT_TRUE(n.ok()) << n.status();
  if (n.ok()) out.resize(*n);
  return out;
}

inline void CheckParity(KernelBackend& backend, const CaseSpec& spec) {
  const ParityCase pc = MakeCase(spec);
  const DynamiqCodec& codec = *pc.codec;
  auto layout = PrepareDynamiqCudaChunk(codec, pc.plan, pc.chunk);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto peer_layout = PrepareDynamiqCudaChunk(codec, pc.peer_plan, pc.chunk);
  ASSERT_TRUE(peer_layout.ok()) << peer_layout.status();
  const DynamiqCudaChunk& c = *layout;
  LevelTable tables[kMaxWidth + 1];
  CopyDynamiqLevelTables(codec, tables);
  const size_t prefix = kChunkHeaderBytes + c.width_map.size();
  auto sgs_of = [&](const std::vector<uint8_t>& chunk_bytes) {
    return std::vector<uint8_t>(chunk_bytes.begin() + std::min(prefix, chunk_bytes.size()), chunk_bytes.end());
  };

  // Compress (both ranks' keys).
  const std::vector<uint8_t> cpu_local = CpuCompress(pc, pc.plan, pc.local);
  const std::vector<uint8_t> cpu_peer = CpuCompress(pc, pc.peer_plan, pc.peer);
  ASSERT_EQ(cpu_local.size(), c.total_bytes());
  const std::vector<uint8_t> peer_sgs = sgs_of(cpu_peer);
  EXPECT_EQ(ByteMismatch(backend.Encode(c, tables, pc.local), sgs_of(cpu_local), c), "") << "encode, rank 0";
  EXPECT_EQ(ByteMismatch(backend.Encode(*peer_layout, tables, pc.peer), peer_sgs, c), "") << "encode, rank 1";

  // Decompress and DecompressAccumulate of the peer's chunk.
  std::vector<float> cpu_decoded(pc.chunk.count, -1.0f);
  ASSERT_TRUE(
      codec.Decompress(pc.plan, pc.chunk, cpu_peer, Dest{cpu_decoded.data(), DType::kFloat32, pc.chunk.begin, nullptr})
          .ok());
  std::vector<float> poisoned(pc.chunk.count, -1.0f);  // decode must overwrite every element
  EXPECT_EQ(FloatMismatch(backend.Decode(c, tables, peer_sgs, poisoned, false), cpu_decoded), "") << "decode";
  std::vector<float> cpu_acc = pc.local;
  ASSERT_TRUE(codec.DecompressAccumulate(pc.plan, pc.chunk, cpu_peer, cpu_acc.data()).ok());
  EXPECT_EQ(FloatMismatch(backend.Decode(c, tables, peer_sgs, pc.local, true), cpu_acc), "") << "decode-accumulate";

  // Fused DAR: decode(peer) + local, re-encoded with rank 0's key.
  std::vector<uint8_t> cpu_dar(codec.MaxEncodedBytes(pc.plan, pc.chunk));
  auto n = codec.DecompressAccumulateRecompress(pc.plan, pc.chunk, cpu_peer, Src(pc.local, pc.chunk),
                                                absl::MakeSpan(cpu_dar));
  ASSERT_TRUE(n.ok()) << n.status();
  cpu_dar.resize(*n);
  EXPECT_EQ(ByteMismatch(backend.Dar(c, tables, peer_sgs, pc.local, false), sgs_of(cpu_dar), c), "") << "DAR";
  EXPECT_EQ(ByteMismatch(backend.Dar(c, tables, peer_sgs, pc.local, true), sgs_of(cpu_dar), c), "") << "DAR in place";

  // Validation: the CPU's bytes pass; each kind of corruption is caught at its super-group, and
  // with two bad super-groups the first is reported.
  EXPECT_EQ(backend.Validate(c, tables, peer_sgs), -1);
  const size_t last = c.widths.size() - 1;
  const int w_last = c.widths[last];
  const int groups_last = NumGroups(static_cast<int>(pc.chunk.count - last * kSuperGroupSize));
  struct Corruption {
    size_t sg;
    size_t byte;  // within the super-group
    uint8_t value;
    const char* what;
  };
  const int w2 = c.widths[2];
  const size_t sg2_bytes = c.offsets[3] - c.offsets[2];
  const std::vector<Corruption> corruptions = {
      {2, static_cast<size_t>(2 * w2), 0, "zero group scale"},
      {2, 0, 0xff, "illegal code"},
      {2, sg2_bytes - 1, 0xbf, "negative super unit"},
      {2, sg2_bytes - 1, 0x7f, "super unit Inf or NaN"},  // with 0x80 in the low byte below
      {last, static_cast<size_t>(groups_last - 1) * (2 * w_last + 1) + 2 * w_last, 0, "last group's scale"},
  };
  for (const Corruption& k : corruptions) {
    std::vector<uint8_t> bad = peer_sgs;
    bad[c.offsets[k.sg] + k.byte] = k.value;
    if (std::string(k.what) == "super unit Inf or NaN") bad[c.offsets[k.sg] + k.byte - 1] = 0x80;  // 0x7f80 = Inf
    if (std::string(k.what) == "illegal code") bad[c.offsets[k.sg] + 1] = 0xff;  // 16 set bits: illegal at any width
    EXPECT_EQ(backend.Validate(c, tables, bad), static_cast<int>(k.sg)) << k.what;
  }
  std::vector<uint8_t> two_bad = peer_sgs;
  two_bad[c.offsets[last] + 2 * w_last] = 0;
  two_bad[c.offsets[5] + 2 * c.widths[5]] = 0;
  EXPECT_EQ(backend.Validate(c, tables, two_bad), 5);
  DynamiqCudaChunk bad_width = c;
  bad_width.widths[7] = 9;  // not a code width
  EXPECT_EQ(backend.Validate(bad_width, tables, peer_sgs), 7);
}

}  // namespace dynamiq::kernels::parity

#endif  // DQ_TESTS_KERNELS_DYNAMIQ_CUDA_PARITY_H_
