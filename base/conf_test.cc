#include "base/conf.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(ConfTest, SplitsItemsInOrder) {
  absl::StatusOr<ConfItems> items = SplitConf(" a:1, b : x:y ,,");
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->size(), 2u);
  EXPECT_EQ((*items)[0], (std::pair<std::string, std::string>("a", "1")));
  EXPECT_EQ((*items)[1], (std::pair<std::string, std::string>("b", "x:y")));
  EXPECT_TRUE(SplitConf("").value().empty());
}

TEST(ConfTest, MalformedItemsAndDuplicatesAreErrors) {
  EXPECT_EQ(SplitConf("driver").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<ConfItems> twice = SplitConf("a:1,a:2");
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("'a' is given twice"), absl::string_view::npos);
}

TEST(ConfTest, ParsesSizes) {
  EXPECT_EQ(ParseSize("4096").value(), 4096u);
  EXPECT_EQ(ParseSize("2M").value(), 2u << 20);
  EXPECT_EQ(ParseSize("16GiB").value(), std::uint64_t{16} << 30);
  EXPECT_EQ(ParseSize("1t").value(), std::uint64_t{1} << 40);
  EXPECT_EQ(ParseSize("512KB").value(), 512u << 10);
  EXPECT_FALSE(ParseSize("").ok());
  EXPECT_FALSE(ParseSize("G").ok());
  EXPECT_FALSE(ParseSize("-1").ok());
  EXPECT_FALSE(ParseSize("99999999999T").ok());
  for (std::uint64_t v : {std::uint64_t{0}, std::uint64_t{1000}, std::uint64_t{3} << 20, std::uint64_t{5} << 40}) {
    EXPECT_EQ(ParseSize(SizeToString(v)).value(), v);
  }
  EXPECT_EQ(SizeToString(std::uint64_t{16} << 30), "16G");
}

TEST(ConfTest, Flags) {
  EXPECT_TRUE(ParseConfFlag("k", "1").value());
  EXPECT_FALSE(ParseConfFlag("k", "false").value());
  absl::StatusOr<bool> bad = ParseConfFlag("bypass", "yes");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'bypass'"), absl::string_view::npos);
}

}  // namespace
}  // namespace vmstash
