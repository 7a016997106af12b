#include "allocator/allocator_options.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(AllocatorOptionsTest, ParsesEveryKeyAndRoundTrips) {
  AllocatorOptions options;
  for (const auto& [k, v] : {std::pair<const char*, const char*>{"bypass", "1"}, {"min_chunk", "4M"},
                             {"max_chunk", "1G"}, {"heap_va", "64G"}, {"backup", "pageable"}, {"auto_prepare", "0"},
                             {"switch_zero", "0"}}) {
    ASSERT_TRUE(ApplyAllocatorOption(k, v, options).ok()) << k;
  }
  EXPECT_TRUE(options.bypass);
  EXPECT_EQ(options.min_chunk_bytes, std::size_t{4} << 20);
  EXPECT_EQ(options.max_chunk_bytes, std::size_t{1} << 30);
  EXPECT_EQ(options.heap_va_bytes, std::size_t{64} << 30);
  EXPECT_EQ(options.backup_store.kind, BackupStore::Kind::kPageable);
  EXPECT_FALSE(options.auto_prepare);
  EXPECT_FALSE(options.switch_zero);
  std::string text;
  AppendAllocatorOptions(options, &text);
  EXPECT_EQ(text, "bypass:1,min_chunk:4M,max_chunk:1G,heap_va:64G,backup:pageable,auto_prepare:0,switch_zero:0");
}

TEST(AllocatorOptionsTest, BadValuesNameKeyAndValue) {
  for (const auto& [k, v] : {std::pair<const char*, const char*>{"bypass", "yes"}, {"min_chunk", "0"},
                             {"max_chunk", "big"}, {"backup", "disk"}, {"auto_prepare", "2"},
                             {"switch_zero", "on"}}) {
    AllocatorOptions options;
    absl::Status s = ApplyAllocatorOption(k, v, options);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k << ":" << v;
    EXPECT_NE(s.message().find(absl::StrCat("'", k, "'")), absl::string_view::npos) << s;
  }
}

}  // namespace
}  // namespace vmstash
