// Schedule: which rank sends which chunk to whom at every step of a multi-hop all-reduce.
// The simulator and the network engines run exactly these schedules.
//
// A bucket of d elements is cut into n chunks of ceil(d/n) rounded up to 256 elements (the last
// ones may be shorter or empty). Reduce-scatter moves every chunk along an in-tree to its owner;
// all-gather then sends the owner's final compressed bytes on unchanged, so every rank decodes
// the same bytes and ends with bit-identical results. owner(c) = (c - 1) mod n in all three.
//
//   ring:      RS step s (0..n-2): rank r sends chunk (r - s) mod n to r + 1. Chunk c travels
//              c -> c+1 -> ... -> c-1 (a path of depth n-1, re-quantized at every hop).
//   butterfly: n a power of two. Pairs (a, b) by level: (0,1),(2,3),... then (1,3),(5,7),...
//              then (3,7),...; at the step of pair (a, b) rank r sends chunk (r - a) to r - a + b.
//              Chunk c's tree is a binomial tree rotated by c (depth log2 n), sink c - 1.
//   Both:      AG step t (0..n-2): rank r sends chunk (r + 1 - t) to r + 1.
//   two_shot:  one RS step: rank r sends every chunk it does not own straight to its owner, to
//              r + 1, r + 2, ... in that order (a tree of depth 1); one AG step: every owner
//              sends its final bytes to r + 1, r + 2, ...
//
//   schedule    steps (RS + AG)    transfers per rank and step    quantizations of a chunk
//   ring        (n-1) + (n-1)      1 send, 1 receive              n
//   butterfly   (n-1) + (n-1)      1 send, 1 receive              log2 n + 1
//   two_shot    1 + 1              n-1 sends, n-1 receives        2
//
// Ring and butterfly move a chunk per rank and step (ring bandwidth); two-shot moves the same bytes
// in two steps (Flash Communication's all-to-all reduce-scatter), so a chunk is quantized twice
// whatever n: once by each leaf, once by its owner, who sums the n - 1 children in fp32.
//
// A schedule is a dependency graph: ValidateSchedule checks what every engine relies on (the CPU
// executor, engine/rank_executor.h, and the NCCL program, engine/nccl_allreduce_program.h), and
// MakeSchedule, where every schedule the engines run is made, returns only schedules it accepts; so
// a new algorithm is a new MakeSchedule case, not a new engine. The engines differ in how many
// transfers they run per rank and step (StepLimits): the CPU executor any number, the NCCL
// program one send and one receive (it refuses the two-shot).
#ifndef DQ_ENGINE_SCHEDULE_H_
#define DQ_ENGINE_SCHEDULE_H_

#include <stddef.h>

#include <limits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/codec.h"

namespace dynamiq::engine {

// kAuto is a configuration value, not a schedule: the engine resolves it for every collective
// (engine/topology_selector.h SelectTopology) and runs the ring or the butterfly (two-shot only
// when configured). The values are stable (the NCCL handshake digests them): new ones go last.
enum class Topology { kRing, kButterfly, kAuto, kTwoShot };

absl::string_view TopologyName(Topology t);
// "ring", "butterfly", "two_shot" or "auto"; INVALID_ARGUMENT naming the choices for anything else.
absl::StatusOr<Topology> ParseTopology(absl::string_view name);

// The schedule id a step header and the NCCL handshake carry (engine/step_header.h), so ranks that
// resolved different schedules fail with an error naming both instead of exchanging wrong chunks.
// Ring 0 (what headers without an id meant), butterfly 1, two-shot 2.
uint8_t ScheduleId(Topology t);

struct Transfer {
  int from = 0;
  int to = 0;
  int chunk = 0;
};

struct Schedule {
  Topology topology = Topology::kRing;
  int world_size = 1;
  std::vector<std::vector<Transfer>> reduce_scatter;  // steps, in order
  std::vector<std::vector<Transfer>> all_gather;
  std::vector<int> owner;  // owner[c]: the rank that finishes chunk c
};

// INVALID_ARGUMENT for n < 1, butterfly with n not a power of two, or kAuto (resolve it first).
// The result passes ValidateSchedule (with the CPU executor's limits).
absl::StatusOr<Schedule> MakeSchedule(Topology topology, int world_size);

// How many transfers one rank may take part in at one step, as an engine runs them.
struct StepLimits {
  int sends = std::numeric_limits<int>::max();
  int receives = std::numeric_limits<int>::max();
};
// The CPU executor (engine/rank_executor.h, engine::AllReduce, the simulator): any number.
inline constexpr StepLimits kCpuStepLimits{};
// The NCCL program (engine/nccl_allreduce_program.h): one NCCL group per step and block, with one
// send and one receive.
inline constexpr StepLimits kNcclStepLimits{1, 1};

// Checks the schedule as a dependency graph; INVALID_ARGUMENT naming the first violation:
//   - n chunks with one owner each, every rank owning exactly one; ranks and chunks in range;
//     no rank sends to itself; at most `limits` transfers per rank and step, and at most one from
//     a rank to another per step (a message is named by its phase, step, block and sender);
//   - reduce-scatter: every rank but a chunk's owner sends the chunk exactly once, the owner
//     never, and a rank sends a chunk only after every transfer of that chunk to it arrived at an
//     earlier step (so each chunk's transfers form an in-tree rooted at its owner: no cycles, every
//     rank's contribution reaches the owner once);
//   - all-gather: every rank but the owner receives the chunk's final bytes exactly once, from a
//     rank that holds them at that step (the owner, or one that received them at an earlier step).
absl::Status ValidateSchedule(const Schedule& schedule, StepLimits limits = kCpuStepLimits);

// Elements of chunk c (0 <= c < n) of a d-element bucket.
kernels::ChunkRef ChunkOf(size_t num_elements, int world_size, int chunk);

// `elements`, chunk `chunk` of the schedule, as `rank` compresses it for `peer` in the
// reduce-scatter: with the rounding fields of its siblings (every rank that sends that chunk to
// that peer, in step order and within a step in the schedule's order, e.g. the two-shot's n - 1
// leaves of one step) for correlated rounding (see kernels::ChunkRef).
kernels::ChunkRef SiblingRef(const Schedule& schedule, const kernels::ChunkRef& elements, int chunk, int rank,
                             int peer);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_SCHEDULE_H_
