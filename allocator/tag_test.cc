#include "allocator/tag.h"

#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(TagTest, DefaultTagIsZeroAndCurrent) {
  EXPECT_EQ(TagName(kDefaultTag), "default");
  EXPECT_EQ(*InternTag("default"), kDefaultTag);
  EXPECT_EQ(CurrentTag(), kDefaultTag);
}

TEST(TagTest, InterningIsStable) {
  absl::StatusOr<TagId> a = InternTag("kv_cache");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*InternTag("kv_cache"), *a);
  EXPECT_EQ(TagName(*a), "kv_cache");
  EXPECT_NE(*InternTag("weights"), *a);
  EXPECT_EQ(TagName(-1), "");
  EXPECT_EQ(TagName(kMaxTags), "");
}

TEST(TagTest, InvalidNamesAreRejected) {
  EXPECT_EQ(InternTag("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InternTag(std::string(65, 'a')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(InternTag(std::string(64, 'a')).ok());
  EXPECT_EQ(InternTag("kv cache").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InternTag("tab\there").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InternTag(std::string("nul\0x", 5)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InternTag("caf\xc3\xa9").status().code(), absl::StatusCode::kInvalidArgument);
}

// Issue 28 item 4: lookups of names that only have to exist (remote pause, resume,
// switch) must not intern them.
TEST(TagTest, FindTagNeverInterns) {
  const TagId kv = *InternTag("find_kv");
  EXPECT_EQ(*FindTag("find_kv"), kv);
  EXPECT_EQ(*FindTag("default"), kDefaultTag);
  const int before = TagCount();
  for (int i = 0; i < 5000; ++i) {
    EXPECT_EQ(FindTag("find_missing_" + std::to_string(i)).status().code(), absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(TagCount(), before);
  absl::Status missing = FindTag("find_typo").status();
  EXPECT_NE(missing.message().find("'find_typo'"), absl::string_view::npos) << missing;
  EXPECT_EQ(FindTag("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FindTag(std::string(65, 'a')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FindTag("kv cache").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TagCount(), before);
}

TEST(TagTest, CurrentTagIsPerThreadAndScoped) {
  TagId kv = *InternTag("kv_cache");
  {
    ScopedTag scope(kv);
    EXPECT_EQ(CurrentTag(), kv);
    TagId seen = -1;
    std::thread([&] { seen = CurrentTag(); }).join();
    EXPECT_EQ(seen, kDefaultTag);
    {
      ScopedTag inner(*InternTag("weights"));
      EXPECT_EQ(TagName(CurrentTag()), "weights");
    }
    EXPECT_EQ(CurrentTag(), kv);
  }
  EXPECT_EQ(CurrentTag(), kDefaultTag);
}

TEST(TagTest, PolicyParsing) {
  EXPECT_EQ(*ParsePolicy("discard"), Policy::kDiscard);
  EXPECT_EQ(*ParsePolicy("backup"), Policy::kBackup);
  EXPECT_EQ(ParsePolicy("keep").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PolicyName(Policy::kBackup), "backup");
}

TEST(TagTest, ConcurrentInterningAgrees) {
  std::vector<std::thread> threads;
  std::vector<TagId> ids(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 100; ++i) ASSERT_TRUE(InternTag("tag_" + std::to_string(i)).ok());
      ids[t] = *InternTag("tag_42");
    });
  }
  for (auto& th : threads) th.join();
  for (TagId id : ids) EXPECT_EQ(id, ids[0]);
}

}  // namespace
}  // namespace vmstash
