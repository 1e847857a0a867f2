#include "engine/schedule.h"

#include <vector>

#include "engine/topology_selector.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

Schedule Make(Topology t, int n) {
  absl::StatusOr<Schedule> s = MakeSchedule(t, n);
  EXPECT_THAT(s, IsOk());
  return s.ok() ? *s : Schedule{};
}

TEST(ScheduleTest, TopologyNamesRoundTripAndAutoIsNamed) {
  for (Topology t : {Topology::kRing, Topology::kButterfly, Topology::kTwoShot, Topology::kAuto}) {
    absl::StatusOr<Topology> parsed = ParseTopology(TopologyName(t));
    ASSERT_THAT(parsed, IsOk());
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(TopologyName(Topology::kAuto), "auto");  // it printed "butterfly" for anything not ring
  EXPECT_EQ(TopologyName(Topology::kTwoShot), "two_shot");
  EXPECT_THAT(ParseTopology("tree"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ring, butterfly, two_shot or auto")));
  EXPECT_THAT(MakeSchedule(Topology::kAuto, 4), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("resolved")));
  EXPECT_NE(ScheduleId(Topology::kRing), ScheduleId(Topology::kButterfly));
  EXPECT_EQ(ScheduleId(Topology::kRing), 0);  // what headers without a schedule id meant
  EXPECT_EQ(ScheduleId(Topology::kButterfly), 1);
  EXPECT_EQ(ScheduleId(Topology::kTwoShot), 2);
}

TEST(ScheduleTest, EveryScheduleWeMakeIsValid) {
  for (int n : {1, 2, 3, 4, 5, 7, 8, 16, 33}) EXPECT_THAT(ValidateSchedule(Make(Topology::kRing, n)), IsOk()) << n;
  for (int n : {1, 2, 4, 8, 16, 64}) EXPECT_THAT(ValidateSchedule(Make(Topology::kButterfly, n)), IsOk()) << n;
  // Ring and butterfly fit the NCCL program's one send and one receive per rank and step.
  for (int n : {1, 2, 3, 5, 8}) EXPECT_THAT(ValidateSchedule(Make(Topology::kRing, n), kNcclStepLimits), IsOk()) << n;
  for (int n : {2, 8}) EXPECT_THAT(ValidateSchedule(Make(Topology::kButterfly, n), kNcclStepLimits), IsOk()) << n;
}

// Two-shot: one reduce-scatter step in which every rank sends each chunk it does not own to the
// chunk's owner, one all-gather step in which every owner sends its chunk to every other rank.
TEST(ScheduleTest, TwoShotIsOneAllToAllStepEachWayAndValidOnlyWithSeveralTransfersPerStep) {
  for (int n = 1; n <= 9; ++n) {
    SCOPED_TRACE(n);
    const Schedule s = Make(Topology::kTwoShot, n);
    EXPECT_EQ(s.topology, Topology::kTwoShot);
    EXPECT_THAT(ValidateSchedule(s), IsOk());
    EXPECT_THAT(ValidateSchedule(s, kCpuStepLimits), IsOk());
    EXPECT_THAT(ValidateSchedule(s, StepLimits{n - 1, n - 1}), IsOk());
    if (n == 1) {
      EXPECT_TRUE(s.reduce_scatter.empty());
      EXPECT_TRUE(s.all_gather.empty());
      continue;
    }
    ASSERT_EQ(s.reduce_scatter.size(), 1u);
    ASSERT_EQ(s.all_gather.size(), 1u);
    ASSERT_EQ(s.reduce_scatter[0].size(), static_cast<size_t>(n * (n - 1)));
    ASSERT_EQ(s.all_gather[0].size(), static_cast<size_t>(n * (n - 1)));
    for (const Transfer& t : s.reduce_scatter[0]) EXPECT_EQ(t.to, s.owner[t.chunk]);
    for (const Transfer& t : s.all_gather[0]) EXPECT_EQ(t.from, s.owner[t.chunk]);
    // Each rank sends first to the rank after it, then the next one...: its receives come in the
    // order their senders send them.
    for (int r = 0; r < n; ++r) {
      std::vector<int> to, from;
      for (const Transfer& t : s.reduce_scatter[0]) {
        if (t.from == r) to.push_back(t.to);
        if (t.to == r) from.push_back(t.from);
      }
      ASSERT_EQ(to.size(), static_cast<size_t>(n - 1));
      for (int i = 1; i < n; ++i) {
        EXPECT_EQ(to[i - 1], (r + i) % n);
        EXPECT_EQ(from[i - 1], (r - i + n) % n);
      }
    }
    if (n > 2) {  // n == 2 is the ring's one send per step
      EXPECT_THAT(ValidateSchedule(s, kNcclStepLimits),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           AllOf(HasSubstr("two_shot schedule for"), HasSubstr("sends more than 1 message"))));
      EXPECT_THAT(ValidateSchedule(s, StepLimits{n - 2, n - 1}), StatusIs(absl::StatusCode::kInvalidArgument));
    } else {
      EXPECT_THAT(ValidateSchedule(s, kNcclStepLimits), IsOk());
    }
  }
}

// The n - 1 leaves that send a chunk to its owner in the same step are siblings of one correlated
// rounding group: one size, distinct indices 0..n-2, one group id per chunk.
TEST(ScheduleTest, TwoShotSiblingsOfOneStepShareARoundingGroup) {
  for (int n : {2, 3, 4, 8}) {
    const Schedule s = Make(Topology::kTwoShot, n);
    for (int c = 0; c < n; ++c) {
      const int owner = s.owner[c];
      std::vector<bool> seen(n - 1, false);
      for (int r = 0; r < n; ++r) {
        if (r == owner) continue;
        const kernels::ChunkRef ref = SiblingRef(s, ChunkOf(4096, n, c), c, r, owner);
        EXPECT_EQ(ref.rounding_size, static_cast<uint32_t>(n - 1)) << n;
        ASSERT_LT(ref.rounding_index, static_cast<uint32_t>(n - 1)) << n;
        EXPECT_FALSE(seen[ref.rounding_index]) << "n " << n << " chunk " << c << " rank " << r;
        seen[ref.rounding_index] = true;
        EXPECT_EQ(ref.rounding_group, static_cast<uint32_t>(c * n + owner));
      }
    }
  }
}

// Each broken schedule below differs from a valid one in one place; the validator names it.
TEST(ScheduleTest, ValidatorRejectsABrokenGraphNamingTheViolation) {
  auto expect_invalid = [](const Schedule& s, absl::string_view what) {
    EXPECT_THAT(ValidateSchedule(s), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what))) << what;
  };
  const Schedule ring = Make(Topology::kRing, 4);

  Schedule s = ring;
  s.owner[1] = s.owner[0];
  expect_invalid(s, "owns more than one chunk");

  s = ring;
  s.reduce_scatter[0][2].to = s.reduce_scatter[0][2].from;
  expect_invalid(s, "sends to itself");

  s = ring;
  s.reduce_scatter[1][0].to = 7;
  expect_invalid(s, "out of range");

  // A rank forwards a chunk before its child's part arrived: swap the ring's first two steps.
  s = ring;
  std::swap(s.reduce_scatter[0], s.reduce_scatter[1]);
  expect_invalid(s, "after it sent its partial sum");

  // A rank's part never leaves it: drop one transfer of the last step.
  s = ring;
  s.reduce_scatter.back().pop_back();
  expect_invalid(s, "never leaves it");

  // The owner sends its own chunk: make rank 0, which sends chunk 0 at step 0, its owner.
  s = ring;
  std::swap(s.owner[0], s.owner[1]);
  expect_invalid(s, "chunk 0's owner 0 sends it");

  // All-gather: a rank forwards a chunk it does not hold yet.
  s = ring;
  std::swap(s.all_gather[0], s.all_gather[1]);
  expect_invalid(s, "before it holds the final bytes");

  // All-gather: a rank never receives a chunk's result.
  s = ring;
  s.all_gather.pop_back();
  expect_invalid(s, "never receives chunk");

  // A one-shot all-gather (each owner sends to both others at once) is a valid graph, within a
  // limit of two transfers per step (and the CPU executor's any), but not within the NCCL
  // program's one.
  s = Make(Topology::kRing, 3);  // owners 2, 0, 1 of chunks 0, 1, 2
  s.all_gather = {{{2, 0, 0}, {2, 1, 0}, {0, 1, 1}, {0, 2, 1}, {1, 0, 2}, {1, 2, 2}}};
  EXPECT_THAT(ValidateSchedule(s, StepLimits{2, 2}), IsOk());
  EXPECT_THAT(ValidateSchedule(s), IsOk());
  EXPECT_THAT(ValidateSchedule(s, kNcclStepLimits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sends more than 1 message")));

  // Two messages on one link in one step could not be told apart (a message is named by phase,
  // step, block and sender).
  s = Make(Topology::kTwoShot, 3);
  s.all_gather[0].push_back(s.all_gather[0][0]);
  expect_invalid(s, "sends to rank 1 twice");
}

TEST(TopologySelectorTest, AutoPicksTheButterflyOnlyWhereItsShallowerTreesPay) {
  const TransportCapabilities tcp{"tcp"};
  const size_t big = size_t{1} << 24;
  auto codec = [](kernels::CodecId id) {
    kernels::CodecConfig c{id};
    if (id == kernels::CodecId::kDynamiq) c.bits = 5;
    absl::StatusOr<std::unique_ptr<kernels::Codec>> made = kernels::CreateCodec(c);
    EXPECT_THAT(made, IsOk());
    return std::move(*made);
  };
  auto dynamiq = codec(kernels::CodecId::kDynamiq), none = codec(kernels::CodecId::kNone);
  // Explicit choices are kept.
  EXPECT_EQ(SelectTopology(Topology::kRing, big, 8, *dynamiq, tcp), Topology::kRing);
  EXPECT_EQ(SelectTopology(Topology::kButterfly, big, 8, *none, tcp), Topology::kButterfly);
  EXPECT_EQ(SelectTopology(Topology::kTwoShot, 4096, 4, *dynamiq, tcp), Topology::kTwoShot);
  // Auto does not pick the two-shot (yet), small buckets included.
  for (int n : {2, 3, 4, 8}) EXPECT_NE(SelectTopology(Topology::kAuto, 4096, n, *dynamiq, tcp), Topology::kTwoShot);
  // A re-quantizing codec on 8, 16 ranks: butterfly; on 4 (one hop of difference), 6 (not a power
  // of two) or a bucket too small to chunk: ring.
  EXPECT_EQ(SelectTopology(Topology::kAuto, big, 8, *dynamiq, tcp), Topology::kButterfly);
  EXPECT_EQ(SelectTopology(Topology::kAuto, big, 16, *dynamiq, tcp), Topology::kButterfly);
  EXPECT_EQ(SelectTopology(Topology::kAuto, big, 4, *dynamiq, tcp), Topology::kRing);
  EXPECT_EQ(SelectTopology(Topology::kAuto, big, 6, *dynamiq, tcp), Topology::kRing);
  EXPECT_EQ(SelectTopology(Topology::kAuto, 1000, 8, *dynamiq, tcp), Topology::kRing);
  // Exact and integer-summing codecs gain nothing from shallow trees.
  EXPECT_EQ(SelectTopology(Topology::kAuto, big, 8, *none, tcp), Topology::kRing);
  EXPECT_EQ(SelectTopology(Topology::kAuto, big, 8, *codec(kernels::CodecId::kGlobalQsgd), tcp), Topology::kRing);
  // A transport without the reliable contract gets the ring.
  TransportCapabilities lossy{"udp"};
  lossy.reliable = false;
  EXPECT_EQ(SelectTopology(Topology::kAuto, big, 8, *dynamiq, lossy), Topology::kRing);
}

}  // namespace
}  // namespace dynamiq::engine
