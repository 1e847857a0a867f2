#include "engine/block_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/dynamiq_math.h"
#include "kernels/wire_format.h"

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
  p.scale_elements = bucket.scale_elements;
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
  joined.scale_elements = blocks[0].scale_elements;
  for (const kernels::BucketPlan& b : blocks) {
    joined.num_elements += b.num_elements;
    joined.widths.insert(joined.widths.end(), b.widths.begin(), b.widths.end());
    joined.local_means.insert(joined.local_means.end(), b.local_means.begin(), b.local_means.end());
    joined.mean_sums.insert(joined.mean_sums.end(), b.mean_sums.begin(), b.mean_sums.end());
  }
  return joined;
}

std::vector<kernels::ChunkRef> BalancedChunks(const kernels::Codec& codec, const kernels::BucketPlan& plan, int n) {
  const size_t sg = kernels::kSuperGroupSize;
  const size_t d = plan.num_elements;
  const size_t groups = (d + sg - 1) / sg;
  std::vector<uint64_t> size(groups);
  uint64_t total = 0, largest = 0;
  for (size_t g = 0; g < groups; ++g) {
    const kernels::ChunkRef one{0, g * sg, std::min(sg, d - g * sg)};
    const size_t bytes = codec.MaxEncodedBytes(plan, one);
    size[g] = bytes > kernels::kChunkHeaderBytes ? bytes - kernels::kChunkHeaderBytes : 0;
    total += size[g];
    largest = std::max(largest, size[g]);
  }
  // The smallest bound on a chunk's bytes for which a greedy left-to-right cut needs <= n chunks.
  const auto chunks_needed = [&](uint64_t bound) {
    int chunks = 1;
    uint64_t acc = 0;
    for (uint64_t s : size) {
      if (acc + s > bound) {
        ++chunks;
        acc = s;
      } else {
        acc += s;
      }
    }
    return chunks;
  };
  uint64_t lo = largest, hi = std::max<uint64_t>(total, largest);
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (chunks_needed(mid) <= n) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  std::vector<kernels::ChunkRef> chunks(n);
  size_t g = 0;
  for (int c = 0; c < n; ++c) {
    const size_t first = g;
    uint64_t acc = 0;
    // Greedy under the bound: chunks_needed(lo) <= n, so the super-groups run out by the last
    // chunk (which takes whatever is left regardless); later chunks may be empty.
    while (g < groups && acc + size[g] <= lo) acc += size[g++];
    if (c == n - 1) g = groups;
    const size_t begin = std::min(d, first * sg), end = std::min(d, g * sg);
    chunks[c] = kernels::ChunkRef{static_cast<uint32_t>(c), begin, end - begin};
  }
  return chunks;
}

}  // namespace dynamiq::engine
