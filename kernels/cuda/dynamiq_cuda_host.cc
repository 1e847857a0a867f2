#include "kernels/cuda/dynamiq_cuda_host.h"

#include <string.h>

#include "absl/strings/str_cat.h"
#include "kernels/dynamiq_math.h"
#include "kernels/random_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {

size_t DynamiqCudaChunk::total_bytes() const { return kChunkHeaderBytes + payload_bytes(); }

absl::StatusOr<DynamiqCudaChunk> PrepareDynamiqCudaChunk(const DynamiqCodec& codec, const BucketPlan& plan,
                                                         const ChunkRef& chunk) {
  // The same checks as DynamiqCodec::ChunkLayout.
  if (plan.widths.size() != DynamiqNumSuperGroups(plan.num_elements) ||
      (chunk.count > 0 && chunk.begin % kSuperGroupSize != 0) || chunk.begin > plan.num_elements ||
      chunk.count > plan.num_elements - chunk.begin || chunk.count > kMaxChunkElements) {
    return absl::InvalidArgumentError(absl::StrCat("chunk [", chunk.begin, ", +", chunk.count,
                                                   ") does not fit the dynamiq plan of ", plan.num_elements,
                                                   " elements / ", plan.widths.size(), " super-groups"));
  }
  DynamiqCudaChunk c;
  const size_t first_sg = chunk.begin / kSuperGroupSize;
  const size_t num_sg = DynamiqNumSuperGroups(chunk.count);
  c.widths.assign(plan.widths.begin() + first_sg, plan.widths.begin() + first_sg + num_sg);
  c.offsets.resize(num_sg);
  c.width_map.assign((num_sg + 1) / 2, 0);
  for (size_t j = 0; j < num_sg; ++j) {
    const int w = c.widths[j];
    if (w != 0 && (w < kMinWidth || w > kMaxWidth)) {
      return absl::InvalidArgumentError(
          absl::StrCat("super-group ", first_sg + j, " has code width ", w, " (expected 0 or 2..8)"));
    }
    const size_t rest = chunk.count - j * kSuperGroupSize;
    const int count = static_cast<int>(rest < static_cast<size_t>(kSuperGroupSize) ? rest : kSuperGroupSize);
    c.offsets[j] = c.sg_bytes;
    c.sg_bytes += SuperGroupBytes(w, count);
    c.width_map[j / 2] = static_cast<uint8_t>(c.width_map[j / 2] | (w << (4 * (j % 2))));
  }
  // Keys as DynamiqCodec::Encode derives them.
  const CodecConfig& config = codec.config();
  const RoundInfo& round = plan.round;
  DynamiqDeviceArgs& a = c.args;
  a.count = chunk.count;
  a.first_sg = first_sg;
  a.key = StreamKey(config.seed, round.round, round.rank);
  a.shared_key = StreamKey(config.seed, round.round, kSharedStream ^ Mix32(chunk.rounding_group));
  a.rounding_index = chunk.rounding_index;
  a.rounding_size = chunk.rounding_size;
  a.correlated = config.correlated_rounding && chunk.rounding_size > 1;
  return c;
}

void CopyDynamiqLevelTables(const DynamiqCodec& codec, LevelTable* tables) {
  memset(tables, 0, sizeof(LevelTable) * kMinWidth);
  for (int w = kMinWidth; w <= kMaxWidth; ++w) tables[w] = codec.table(w);
}

absl::Status WriteDynamiqChunkPrefix(const DynamiqCodec& codec, const BucketPlan& plan, const ChunkRef& chunk,
                                     const DynamiqCudaChunk& layout, uint16_t summands, absl::Span<uint8_t> out) {
  const size_t prefix = kChunkHeaderBytes + layout.width_map.size();
  if (out.size() < prefix) {
    return absl::InvalidArgumentError(absl::StrCat("output buffer of ", out.size(), " bytes, need ", prefix));
  }
  uint8_t uniform_mask = 0;  // bit w - 2: width w uses uniform levels (DynamiqCodec::UniformMask)
  for (int w = kMinWidth; w <= kMaxWidth; ++w) {
    uniform_mask = static_cast<uint8_t>(uniform_mask | (codec.table(w).uniform << (w - kMinWidth)));
  }
  ChunkHeader h;
  h.codec = CodecId::kDynamiq;
  h.element_bits = uniform_mask;
  h.flags = codec.config().correlated_rounding ? kFlagCorrelated : 0;
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = summands;
  h.payload_bytes = static_cast<uint32_t>(layout.payload_bytes());
  WriteChunkHeader(h, out);
  memcpy(out.data() + kChunkHeaderBytes, layout.width_map.data(), layout.width_map.size());
  return absl::OkStatus();
}

}  // namespace dynamiq::kernels
