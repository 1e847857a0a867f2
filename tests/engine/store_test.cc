// engine::InMemoryStore and PrefixStore (engine/store.h): deletion (exact keys, prefixes, and the
// condition that lets the last of several holders delete what they shared) and the limits that
// keep a store from growing without bound.
#include "engine/store.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::IsOkAndHolds;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

bool IsSet(Store& store, const std::string& key) { return store.Get(key, absl::ZeroDuration()).ok(); }

TEST(InMemoryStoreTest, DeletesKeysAndPrefixesAndCountsWhatItHolds) {
  InMemoryStore store;
  for (const char* key : {"a/1", "a/2", "a/10", "ab", "b/1"}) ASSERT_THAT(store.Set(key, "xy"), IsOk());
  EXPECT_EQ(store.size(), 5u);
  EXPECT_EQ(store.bytes(), 3u + 3u + 4u + 2u + 3u + 5u * 2u);

  Store::Deletion exact;
  exact.keys = {"a/1", "missing"};  // a key not set is skipped
  EXPECT_THAT(store.Delete(exact), IsOkAndHolds(1u));
  EXPECT_FALSE(IsSet(store, "a/1"));
  EXPECT_TRUE(IsSet(store, "a/10")) << "an exact key is not a prefix";

  Store::Deletion prefix;
  prefix.prefix = "a/";
  EXPECT_THAT(store.Delete(prefix), IsOkAndHolds(2u));
  EXPECT_TRUE(IsSet(store, "ab"));
  EXPECT_TRUE(IsSet(store, "b/1"));
  EXPECT_EQ(store.size(), 2u);
  EXPECT_EQ(store.bytes(), 2u + 3u + 2u * 2u);
  // Deleted keys can be set again, and a Get waits for them as for any key.
  ASSERT_THAT(store.Set("a/1", "z"), IsOk());
  EXPECT_THAT(store.Get("a/1", absl::Seconds(1)), IsOkAndHolds("z"));
}

TEST(InMemoryStoreTest, TheLastHolderDeletesWhatTheyShared) {
  InMemoryStore store;
  for (const char* key : {"job/live/0", "job/live/1", "job/count", "job/gen0/x"}) {
    ASSERT_THAT(store.Set(key, "1"), IsOk());
  }
  Store::Deletion retire0;
  retire0.keys = {"job/live/0"};
  retire0.prefix = "job/";
  retire0.unless_prefix = "job/live/";
  // Holder 1 is still there: only holder 0's key goes.
  EXPECT_THAT(store.Delete(retire0), IsOkAndHolds(1u));
  EXPECT_EQ(store.size(), 3u);
  Store::Deletion retire1 = retire0;
  retire1.keys = {"job/live/1"};
  EXPECT_THAT(store.Delete(retire1), IsOkAndHolds(3u));
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(store.bytes(), 0u);
}

TEST(InMemoryStoreTest, LimitsRefuseGrowthButNotOverwritesOrDeletions) {
  InMemoryStore store(InMemoryStore::Limits{3, 100});
  for (int i = 0; i < 3; ++i) ASSERT_THAT(store.Set(absl::StrCat("k", i), "v"), IsOk());
  EXPECT_THAT(store.Set("k3", "v"), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("3 keys")));
  EXPECT_THAT(store.CompareAndSet("k3", std::nullopt, "v"), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(store.Set("k0", "w"), IsOk()) << "an existing key can still change";
  EXPECT_THAT(store.Set("k0", std::string(200, 'x')),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit of 100")));
  EXPECT_THAT(store.Get("k0", absl::ZeroDuration()), IsOkAndHolds("w"));
  Store::Deletion one;
  one.keys = {"k1"};
  EXPECT_THAT(store.Delete(one), IsOkAndHolds(1u));
  EXPECT_THAT(store.Set("k3", "v"), IsOk()) << "room again once a key is deleted";
  EXPECT_EQ(store.size(), 3u);
}

// GetMany: the current values, nullopt for keys not set, without waiting; a PrefixStore reads
// under its prefix.
TEST(StoreTest, GetManyReadsWhatIsSetWithoutWaiting) {
  InMemoryStore base;
  ASSERT_TRUE(base.Set("a", "1").ok());
  ASSERT_TRUE(base.Set("p/a", "2").ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<std::optional<std::string>>> values = base.GetMany({"a", "b", "p/a"});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<std::optional<std::string>>{"1", std::nullopt, "2"}));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  PrefixStore scoped("p", base);  // keys "p/<key>"
  values = scoped.GetMany({"a", "b"});
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<std::optional<std::string>>{"2", std::nullopt}));
}

TEST(PrefixStoreTest, DeletesUnderItsPrefixOnly) {
  InMemoryStore base;
  PrefixStore a("g/a", base), b("g/b", base);
  ASSERT_THAT(a.Set("x/1", "1"), IsOk());
  ASSERT_THAT(a.Set("hold", "1"), IsOk());
  ASSERT_THAT(b.Set("x/1", "1"), IsOk());
  Store::Deletion d;
  d.prefix = "x/";
  d.unless_prefix = "hold";
  EXPECT_THAT(a.Delete(d), IsOkAndHolds(0u)) << "a's hold key is set";
  d.keys = {"hold"};
  EXPECT_THAT(a.Delete(d), IsOkAndHolds(2u));
  EXPECT_FALSE(IsSet(base, "g/a/x/1"));
  EXPECT_TRUE(IsSet(base, "g/b/x/1"));
}

}  // namespace
}  // namespace dynamiq::engine
