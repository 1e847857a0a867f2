// Codec: the compression interface every all-reduce path (simulator, Gloo engine, NCCL engine)
// drives. A codec turns fp32/bf16 partial sums into self-describing compressed chunks
// (kernels/wire_format.h) and back, with the four operations multi-hop aggregation needs:
//
//   leaf           Compress(local)                          -> bytes
//   internal node  DecompressAccumulate(bytes, acc)         (every child but the last)
//                  DecompressAccumulateRecompress(bytes, local or acc) -> bytes   (last child)
//   all-gather     Decompress(bytes)                        -> values
//
// DecompressAccumulateRecompress (DAR) is one fused pass: decode, add, re-quantize from the new
// partial sum, with work memory of one super-group (never a decoded copy of the chunk).
//
// Some codecs need bucket-level agreement before chunks flow (DynamiQ's bit allocation, THC's
// global norm). They declare statistics (StatsLength, ComputeStats) that the caller reduces
// across ranks (stats_reduction) and turns into a BucketPlan with MakePlan. Every rank must pass
// bit-identical reduced statistics; MakePlan is deterministic, so all ranks get the same plan.
//
// One call's work may be split across threads: ComputeStats and the chunk-level calls have variants
// taking a common::ThreadPool (ComputeStatsOn, CompressOn, ...), and ParallelCodec
// (kernels/parallel_codec.h) routes a codec's plain calls to them: that is how the engine's calls
// reach them.
//
// Thread safety: a Codec is immutable after construction; all methods are const and may be
// called concurrently from many threads.
#ifndef DQ_KERNELS_CODEC_H_
#define DQ_KERNELS_CODEC_H_

#include <stddef.h>
#include <stdint.h>

#include <array>
#include <optional>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec_info.h"
#include "kernels/dtype.h"

namespace dynamiq::common {
class ThreadPool;
}  // namespace dynamiq::common

namespace dynamiq::kernels {

// How DynamiQ spreads its bit budget over super-groups.
enum class BitAllocator : uint8_t {
  kMeasured = 0,  // minimise total error using the quantizer's measured per-width error
  kPaper = 1,     // the paper's thresholds (each extra bit assumed to cut the error 4x)
};
// DynamiQ level placement within a group.
enum class LevelKind : uint8_t {
  kAuto = 0,     // per width, whichever measured lower error: MEE at 2/4 bits, uniform at 8 bits
  kMee = 1,      // non-uniform, exponentially spaced at every width (the paper's MEE)
  kUniform = 2,  // uniform at every width (the paper's AEE)
};

struct CodecConfig {
  CodecId id = CodecId::kDynamiq;
  // DynamiQ: average bits per coordinate including all metadata (3..8, fractional allowed).
  // Uniform: bits per code (2..8). THC: bits per code on the first hop (4). Others: ignored.
  double bits = 5.0;
  BitAllocator allocator = BitAllocator::kMeasured;
  LevelKind levels = LevelKind::kAuto;
  // Stratified rounding among sibling compressions (DynamiQ, uniform): exactly one sibling per
  // stratum (see ChunkRef). Unbiased, and lowers the error where trees have siblings (butterfly).
  bool correlated_rounding = true;
  // Shared by all ranks of a job; with the round number it keys every random draw.
  uint64_t seed = 0x9d5e0c1a2b3c4d5eull;
};

// Identifies one collective. Identical on all ranks except `rank`.
struct RoundInfo {
  uint64_t round = 0;  // collective sequence number within the job
  uint32_t rank = 0;
  uint32_t world_size = 1;
  // DynamiQ: this collective's average bits per coordinate instead of CodecConfig::bits (0: the
  // config's). One bit budget per step gives each bucket its share (kernels::StepBudgets).
  double bits = 0;
};

// A contiguous range of elements of a bucket. Chunk boundaries other than the bucket's end are
// multiples of kSuperGroupSize (256).
//
// The rounding fields say which quantizations may use correlated (stratified) rounding: the
// `rounding_size` siblings of an aggregation tree (compressions whose sum a parent decodes, and
// whose inputs do not depend on each other's randomness) share `rounding_group`, and this one is
// sibling `rounding_index`. Correlating anything else, e.g. the successive hops of a ring, makes
// the result biased: a hop's rounding probability depends on the previous hop's outcome (scales
// are recomputed from the partial sum), so its threshold must be independent of that outcome.
// rounding_size == 1 means independent rounding.
struct ChunkRef {
  uint32_t chunk_id = 0;
  size_t begin = 0;
  size_t count = 0;
  uint32_t rounding_index = 0;
  uint32_t rounding_size = 1;
  uint32_t rounding_group = 0;
};

// A rank's local values, read-only. data[i] holds bucket element `first + i`. When
// `subtract_per_group` is set, element k contributes data[k - first] - subtract_per_group[k / 256].
struct Source {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  size_t first = 0;
  const float* subtract_per_group = nullptr;
};

// Where decoded values go: data[k - first] = decoded[k] + add_per_group[k / 256] (if set),
// rounded to `dtype` (bf16: round to nearest even).
struct Dest {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  size_t first = 0;
  const float* add_per_group = nullptr;
};

// Everything about one bucket's collective that all ranks agree on (plus this rank's offsets).
struct BucketPlan {
  RoundInfo round;
  size_t num_elements = 0;
  // DynamiQ: code width (0, 2, 4 or 8 bits) of every super-group of 256 elements.
  std::vector<uint8_t> widths;
  // DynamiQ mean-centering: the per-super-group offset every rank subtracts before compressing,
  // and the sum over ranks of what was subtracted, added back after decompressing. Empty for
  // other codecs.
  std::vector<float> local_means;
  std::vector<float> mean_sums;
  // THC: the largest L2 norm of any rank's bucket.
  float global_scale = 0.0f;
  // THC: the element count the global norm is spread over, sqrt(scale_elements) / global_scale
  // normalizing a coordinate: the whole (rotated) bucket's, kept when the bucket is cut into
  // pipelining blocks (engine/block_plan.h SliceBucketPlan). 0: num_elements.
  size_t scale_elements = 0;
};

enum class StatsReduction : uint8_t { kSum, kMax };

// DATA_LOSS "payload failed its checksum (corrupted in transit)": what the *Verified calls return
// for a message whose checksum does not match.
absl::Status PayloadChecksumError();

class Codec {
 public:
  virtual ~Codec() = default;

  const CodecConfig& config() const { return config_; }
  CodecId id() const { return config_.id; }
  // One line: name, parameters and the exact bits per coordinate on the wire.
  virtual std::string Describe() const = 0;
  // False for codecs whose aggregation is only defined along a path (THC sums integers hop by
  // hop and cannot re-quantize an fp32 accumulator fed by several children).
  virtual bool SupportsButterfly() const { return true; }
  // Measured relative squared error of one quantization per code width (index = bits, 2..8 used),
  // for codecs with variable code widths (DynamiQ): what one budget per step plans with
  // (server/step_budget_planner.h). Null for the others.
  virtual const std::array<double, 9>* MeasuredWidthErrors() const { return nullptr; }

  // ---- Whole-bucket transform (THC's rotation). A codec that NeedsBucketTransform works on a
  // transformed bucket of TransformedLength(d) floats: the caller loads its d values into such a
  // buffer (zero-padded), runs ForwardTransform, hands the buffer to the statistics, plans and
  // chunk-level calls below as the bucket (TransformedLength(d) elements), and after the
  // all-gather runs InverseTransform on the summed buffer and keeps its first d values
  // (kernels/cpu/bucket_transform.h does all of this). Both transforms are linear and
  // deterministic: every rank, decoding the same bytes, gets the same result. `round` keys the
  // transform's randomness (its `round` field only; the same on every rank). Defaults: no
  // transform (length d; the calls are UNIMPLEMENTED).
  virtual bool NeedsBucketTransform() const { return false; }
  virtual absl::StatusOr<size_t> TransformedLength(size_t num_elements) const { return num_elements; }
  virtual absl::Status ForwardTransform(const RoundInfo& round, absl::Span<float> values) const;
  virtual absl::Status InverseTransform(const RoundInfo& round, absl::Span<float> values) const;

  // ---- Bucket level. Defaults: no statistics, a plan with only `round` and `num_elements`.
  virtual size_t StatsLength(size_t num_elements) const;
  virtual StatsReduction stats_reduction() const { return StatsReduction::kSum; }
  // Writes StatsLength(num_elements) floats describing local[0, num_elements).
  virtual void ComputeStats(const Source& local, size_t num_elements, float* stats) const;
  virtual absl::StatusOr<BucketPlan> MakePlan(const RoundInfo& round, size_t num_elements,
                                              absl::Span<const float> local_stats,
                                              absl::Span<const float> reduced_stats) const;

  // ---- Chunk level.
  // Upper bound of the bytes Compress/DAR write for `chunk` (header included).
  virtual size_t MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const = 0;
  // Encodes local[chunk] (a partial sum of one contribution). Returns the bytes written.
  virtual absl::StatusOr<size_t> Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                          absl::Span<uint8_t> out) const = 0;
  // Decodes `in` (which must describe `chunk` of plan's round) into `out`.
  virtual absl::Status Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                  const Dest& out) const = 0;
  // acc[i] += decoded element chunk.begin + i. `acc` holds chunk.count floats.
  virtual absl::Status DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                            float* acc) const = 0;
  // Fused: encodes decode(in) + local[chunk] (a partial sum of one more contribution).
  virtual absl::StatusOr<size_t> DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                                absl::Span<const uint8_t> in, const Source& local,
                                                                absl::Span<uint8_t> out) const = 0;
  // Compress and DecompressAccumulateRecompress that also set `checksum` to PayloadChecksum of the
  // bytes written (kernels/payload_checksum.h), which the engine's step header carries. The
  // defaults checksum the output afterwards; none and bf16 checksum as they write (one pass over
  // the message instead of two) and say so with ChecksumsWhileEncoding.
  virtual bool ChecksumsWhileEncoding() const { return false; }
  virtual absl::StatusOr<size_t> CompressChecksummed(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                                     absl::Span<uint8_t> out, uint64_t& checksum) const;
  // Codecs whose message is its chunk header (kChunkHeaderBytes) followed by the chunk's values as
  // they are, little-endian fp32 (none), say so with BodyIsFloat32: the engine may then keep a
  // message's body in fp32 memory it already holds, sending it from the input and receiving it
  // straight into the output (engine/rank_executor.h), instead of copying it through a buffer. The
  // three calls below work on such split messages (PayloadChecksum is of the header and then the
  // body); the defaults are UNIMPLEMENTED.
  virtual bool BodyIsFloat32() const { return false; }
  // The header Compress would write for `chunk` (one contribution, the body: its values).
  virtual absl::Status WriteFloat32Head(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<uint8_t> head) const;
  // Checks a received header of `chunk` whose body (any fp32 values) is elsewhere.
  virtual absl::Status CheckFloat32Head(const BucketPlan& plan, const ChunkRef& chunk,
                                        absl::Span<const uint8_t> head) const;
  // DecompressAccumulateRecompressVerified (Checksummed when `expected` is empty) writing the
  // message's header into `head` and its values, chunk.count floats, to `body`.
  virtual absl::Status DecompressAccumulateRecompressSplit(const BucketPlan& plan, const ChunkRef& chunk,
                                                           absl::Span<const uint8_t> in,
                                                           std::optional<uint64_t> expected, const Source& local,
                                                           absl::Span<uint8_t> head, float* body,
                                                           uint64_t& checksum) const;

  // Decompress and DecompressAccumulateRecompress of a received message whose PayloadChecksum must
  // be `expected` (its step header's): DATA_LOSS "failed its checksum" otherwise, and then what was
  // written is garbage (the collective fails). The defaults verify, then decode; codecs that
  // ChecksumsWhileEncoding verify as they decode (one pass over the message instead of two).
  virtual absl::Status DecompressVerified(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                          const Dest& out, uint64_t expected) const;
  virtual absl::StatusOr<size_t> DecompressAccumulateRecompressVerified(const BucketPlan& plan, const ChunkRef& chunk,
                                                                        absl::Span<const uint8_t> in, uint64_t expected,
                                                                        const Source& local, absl::Span<uint8_t> out,
                                                                        uint64_t& checksum) const;
  virtual absl::StatusOr<size_t> DecompressAccumulateRecompressChecksummed(const BucketPlan& plan,
                                                                           const ChunkRef& chunk,
                                                                           absl::Span<const uint8_t> in,
                                                                           const Source& local, absl::Span<uint8_t> out,
                                                                           uint64_t& checksum) const;

  // ---- The same calls with one call's work split across the threads of `pool` (null: this
  // thread only). A codec whose work falls into independent ranges (DynamiQ: its super-groups)
  // overrides them, with results (bytes, values, errors) bit-identical to the plain calls for any
  // pool size; the defaults make the plain call on the calling thread.
  virtual void ComputeStatsOn(common::ThreadPool* pool, const Source& local, size_t num_elements, float* stats) const;
  virtual absl::StatusOr<size_t> CompressOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                            const Source& local, absl::Span<uint8_t> out) const;
  virtual absl::Status DecompressOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                    absl::Span<const uint8_t> in, const Dest& out) const;
  virtual absl::Status DecompressAccumulateOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                              absl::Span<const uint8_t> in, float* acc) const;
  virtual absl::StatusOr<size_t> DecompressAccumulateRecompressOn(common::ThreadPool* pool, const BucketPlan& plan,
                                                                  const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                                                  const Source& local, absl::Span<uint8_t> out) const;

 protected:
  explicit Codec(const CodecConfig& config) : config_(config) {}

 private:
  CodecConfig config_;
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CODEC_H_
