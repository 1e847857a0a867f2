#include "engine/block_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::engine {

size_t BlockElements(size_t num_elements, size_t block_elements) {
  const size_t sg = kernels::kSuperGroupSize;
  const size_t block = block_elements == 0 ? num_elements : block_elements;
  return std::max<size_t>(sg, (block + sg - 1) / sg * sg);
}

absl::StatusOr<size_t> NumBlocks(size_t num_elements, size_t block_elements) {
  const size_t block = BlockElements(num_elements, block_elements);
  const size_t blocks = num_elements == 0 ? 1 : (num_elements + block - 1) / block;
  if (blocks > kMaxBlocks) {
    return absl::InvalidArgumentError(absl::StrCat("a bucket of ", num_elements, " elements in blocks of ", block,
                                                   " is too many pipelining blocks; raise block_elements"));
  }
  return blocks;
}

kernels::RoundInfo BlockRound(uint64_t sequence, size_t k, int rank, int world_size) {
  return kernels::RoundInfo{sequence * kMaxBlocks + k, static_cast<uint32_t>(rank), static_cast<uint32_t>(world_size)};
}

bool PlansPerBlock(const kernels::Codec& codec) {
  return codec.StatsLength(kernels::kSuperGroupSize) > 0 && codec.stats_reduction() == kernels::StatsReduction::kSum;
}

BlockStats BlockStatsRange(const kernels::Codec& codec, size_t num_elements, size_t block, size_t k) {
  BlockStats b;
  const size_t begin = std::min(k * block, num_elements);
  b.count = std::min(block, num_elements - begin);
  b.offset = codec.StatsLength(begin);
  b.length = codec.StatsLength(b.count);
  return b;
}

kernels::BucketPlan SliceBucketPlan(const kernels::BucketPlan& bucket, uint64_t sequence, size_t k, size_t begin,
                                    size_t count) {
  const size_t sg = kernels::kSuperGroupSize;
  const size_t sg0 = begin / sg, sgs = (count + sg - 1) / sg;
  kernels::BucketPlan p;
  p.round = BlockRound(sequence, k, static_cast<int>(bucket.round.rank), static_cast<int>(bucket.round.world_size));
  p.round.bits = bucket.round.bits;
  p.num_elements = count;
  p.global_scale = bucket.global_scale;
  if (!bucket.widths.empty()) p.widths.assign(bucket.widths.begin() + sg0, bucket.widths.begin() + sg0 + sgs);
  if (!bucket.local_means.empty()) {
    p.local_means.assign(bucket.local_means.begin() + sg0, bucket.local_means.begin() + sg0 + sgs);
    p.mean_sums.assign(bucket.mean_sums.begin() + sg0, bucket.mean_sums.begin() + sg0 + sgs);
  }
  return p;
}

kernels::BucketPlan JoinBlockPlans(absl::Span<const kernels::BucketPlan> blocks, uint64_t sequence) {
  kernels::BucketPlan joined;
  if (blocks.empty()) return joined;
  joined.round = kernels::RoundInfo{sequence, blocks[0].round.rank, blocks[0].round.world_size, blocks[0].round.bits};
  joined.global_scale = blocks[0].global_scale;
  for (const kernels::BucketPlan& b : blocks) {
    joined.num_elements += b.num_elements;
    joined.widths.insert(joined.widths.end(), b.widths.begin(), b.widths.end());
    joined.local_means.insert(joined.local_means.end(), b.local_means.begin(), b.local_means.end());
    joined.mean_sums.insert(joined.mean_sums.end(), b.mean_sums.begin(), b.mean_sums.end());
  }
  return joined;
}

}  // namespace dynamiq::engine
