// GroupView (server/group_view.h): members checked and sorted, a node's place, the store's text.
#include "server/group_view.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::IsOkAndHolds;
using ::dynamiq::testing::StatusIs;
using ::testing::ElementsAre;

TEST(GroupViewTest, MembersAreCheckedSortedAndRoundTripThroughTheStore) {
  EXPECT_THAT(GroupView::Make(1, {}, 0, 3, 0).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(GroupView::Make(1, {0, 3}, 0, 3, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "view 1: node 3 is not a node of this cluster of 3"));
  EXPECT_THAT(GroupView::Make(1, {1, 1}, 0, 3, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "view 1: node 1 is named twice"));
  absl::StatusOr<GroupView> view = GroupView::Make(4, {2, 0}, 17, 3, 2);
  ASSERT_THAT(view, IsOk());
  EXPECT_THAT(view->members(), ElementsAre(0, 2));
  EXPECT_EQ(view->my_index(), 1);
  EXPECT_EQ(view->IndexOf(1), -1);
  EXPECT_EQ(view->Encode(), "4|17|0,2");
  EXPECT_EQ(view->ToString(), "view 4 (nodes 0, 2 from collective 17)");
  EXPECT_THAT(GroupView::Decode(view->Encode(), 3, 2), IsOkAndHolds(*view));
  // Another node reads the same view with its own place in it.
  absl::StatusOr<GroupView> at_node1 = GroupView::Decode("4|17|0,2", 3, 1);
  ASSERT_THAT(at_node1, IsOk());
  EXPECT_FALSE(at_node1->is_member());
  for (const char* bad : {"", "4|17", "4|17|", "4|x|0", "4|17|0,,1", "4|17|0,9"}) {
    EXPECT_THAT(GroupView::Decode(bad, 3, 0).status(), StatusIs(absl::StatusCode::kDataLoss)) << bad;
  }
  const GroupView everyone = GroupView::Everyone(3, 1);
  EXPECT_EQ(everyone.epoch(), 0u);
  EXPECT_THAT(everyone.members(), ElementsAre(0, 1, 2));
  EXPECT_EQ(everyone.my_index(), 1);
}

}  // namespace
}  // namespace dynamiq::server
