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
using ::testing::HasSubstr;

Schedule Make(Topology t, int n) {
  absl::StatusOr<Schedule> s = MakeSchedule(t, n);
  EXPECT_THAT(s, IsOk());
  return s.ok() ? *s : Schedule{};
}

TEST(ScheduleTest, TopologyNamesRoundTripAndAutoIsNamed) {
  for (Topology t : {Topology::kRing, Topology::kButterfly, Topology::kAuto}) {
    absl::StatusOr<Topology> parsed = ParseTopology(TopologyName(t));
    ASSERT_THAT(parsed, IsOk());
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(TopologyName(Topology::kAuto), "auto");  // it printed "butterfly" for anything not ring
  EXPECT_THAT(ParseTopology("tree"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ring, butterfly or auto")));
  EXPECT_THAT(MakeSchedule(Topology::kAuto, 4), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("resolved")));
  EXPECT_NE(ScheduleId(Topology::kRing), ScheduleId(Topology::kButterfly));
  EXPECT_EQ(ScheduleId(Topology::kRing), 0);  // what headers without a schedule id meant
}

TEST(ScheduleTest, EveryScheduleWeMakeIsValid) {
  for (int n : {1, 2, 3, 4, 5, 7, 8, 16, 33}) EXPECT_THAT(ValidateSchedule(Make(Topology::kRing, n)), IsOk()) << n;
  for (int n : {1, 2, 4, 8, 16, 64}) EXPECT_THAT(ValidateSchedule(Make(Topology::kButterfly, n)), IsOk()) << n;
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
  // limit of two transfers per step, but not within today's executors' one.
  s = Make(Topology::kRing, 3);  // owners 2, 0, 1 of chunks 0, 1, 2
  s.all_gather = {{{2, 0, 0}, {2, 1, 0}, {0, 1, 1}, {0, 2, 1}, {1, 0, 2}, {1, 2, 2}}};
  EXPECT_THAT(ValidateSchedule(s, StepLimits{2, 2}), IsOk());
  expect_invalid(s, "sends more than 1 message");
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
