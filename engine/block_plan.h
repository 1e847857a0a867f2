// How a bucket is cut into pipelining blocks and how every block gets its plan. Shared by
// engine::AllReduce and the NCCL program (engine/nccl_allreduce_program.h), which must agree bit
// for bit.
//
// Blocks are block_elements (rounded up to a multiple of 256) long, the last one shorter; block k
// has its own round, sequence * kMaxBlocks + k, which keys the codec's randomness and is checked
// in every chunk header.
//
// Codecs whose statistics are sums (DynamiQ) plan every block on its own: codec.MakePlan
// allocates the block's bit widths from the block's slice of the reduced statistics alone
// (BlockStatsRange), so blocks are planned one by one as the pipeline starts and the first
// block's messages leave without waiting for the whole bucket's plan. The bit budget holds per
// block, so per bucket too. Codecs with other statistics (THC: maxima) plan the whole bucket
// once and every block takes its slice.
#ifndef DQ_ENGINE_BLOCK_PLAN_H_
#define DQ_ENGINE_BLOCK_PLAN_H_

#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

inline constexpr size_t kMaxBlocks = size_t{1} << 20;

// The block size for a bucket of `num_elements`: block_elements rounded up to a multiple of 256
// (at least 256); 0 = the whole bucket.
size_t BlockElements(size_t num_elements, size_t block_elements);

// Blocks of a bucket (1 for an empty one). INVALID_ARGUMENT past kMaxBlocks.
absl::StatusOr<size_t> NumBlocks(size_t num_elements, size_t block_elements);

// Block k's round.
kernels::RoundInfo BlockRound(uint64_t sequence, size_t k, int rank, int world_size);

// True when every block is planned from its own reduced statistics (sums), see above.
bool PlansPerBlock(const kernels::Codec& codec);

// Where block k's statistics lie in the bucket's: statistics are per super-group and blocks start
// on super-group boundaries, so the slice starts at StatsLength(begin).
struct BlockStats {
  size_t count = 0;   // elements of the block
  size_t offset = 0;  // of its statistics
  size_t length = 0;
};
BlockStats BlockStatsRange(const kernels::Codec& codec, size_t num_elements, size_t block, size_t k);

// Block k's slice [begin, begin + count) of a whole-bucket plan, with the block's round.
kernels::BucketPlan SliceBucketPlan(const kernels::BucketPlan& bucket, uint64_t sequence, size_t k, size_t begin,
                                    size_t count);

// The whole-bucket plan made of consecutive block plans (for backends that keep bucket-wide
// arrays); its round is the collective's (block 0's rank and world size, round `sequence`).
kernels::BucketPlan JoinBlockPlans(absl::Span<const kernels::BucketPlan> blocks, uint64_t sequence);

// Size-balanced splitting (after OSCAR; AllReduceOptions::balanced_chunks): the n chunks of a
// block planned as `plan`, cut on super-group boundaries so that their encoded sizes are as equal
// as possible (the largest is minimal among contiguous splits), instead of ChunkOf's equal element
// counts. A super-group's size is what the codec encodes for it alone (MaxEncodedBytes of a
// one-super-group chunk, header excluded), so every rank, which has the same plan, cuts the same
// chunks. Chunk c is ChunkRef{c, begin, count}; trailing chunks may be empty (at the block's end).
// Codecs whose super-groups all cost the same get ChunkOf's split, up to where the rounding falls.
std::vector<kernels::ChunkRef> BalancedChunks(const kernels::Codec& codec, const kernels::BucketPlan& plan, int n);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_BLOCK_PLAN_H_
