#include "allocator/allocator_options.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(AllocatorOptionsTest, ParsesEveryKeyAndRoundTrips) {
  AllocatorOptions options;
  for (const auto& [k, v] : {std::pair<const char*, const char*>{"bypass", "1"}, {"min_chunk", "4M"},
                             {"max_chunk", "1G"}, {"heap_va", "64G"}, {"backup", "pageable"}, {"auto_prepare", "0"},
                             {"switch_zero", "0"}, {"host_max", "64G"}, {"spill_dir", "/tmp"}, {"share_chunks", "1"}}) {
    ASSERT_TRUE(ApplyAllocatorOption(k, v, options).ok()) << k;
  }
  EXPECT_TRUE(options.bypass);
  EXPECT_EQ(options.min_chunk_bytes, std::size_t{4} << 20);
  EXPECT_EQ(options.max_chunk_bytes, std::size_t{1} << 30);
  EXPECT_EQ(options.heap_va_bytes, std::size_t{64} << 30);
  EXPECT_EQ(options.backup_store.kind, BackupStore::Kind::kPageable);
  EXPECT_FALSE(options.auto_prepare);
  EXPECT_FALSE(options.switch_zero);
  EXPECT_EQ(options.host_max_bytes, std::size_t{64} << 30);
  EXPECT_EQ(options.spill_dir, "/tmp");
  EXPECT_TRUE(options.share_chunks);
  std::string text;
  AppendAllocatorOptions(options, &text);
  EXPECT_EQ(text,
            "bypass:1,min_chunk:4M,max_chunk:1G,heap_va:64G,backup:pageable,auto_prepare:0,switch_zero:0,"
            "host_max:64G,share_chunks:1,spill_dir:/tmp");
}

TEST(AllocatorOptionsTest, HostMaxAndSpillDirDefaultToNoCapAndNoSpill) {
  AllocatorOptions options;
  EXPECT_EQ(options.host_max_bytes, 0u);
  EXPECT_EQ(options.spill_dir, "");
  std::string text;
  AppendAllocatorOptions(options, &text);
  EXPECT_NE(text.find(",host_max:0"), std::string::npos) << text;
  EXPECT_EQ(text.find("spill_dir"), std::string::npos) << "an absent spill_dir is not printed: " << text;
  // Every size suffix the other size keys take; 0 is "no cap", not an error.
  for (const auto& [v, bytes] : {std::pair<const char*, std::size_t>{"512M", std::size_t{512} << 20},
                                 {"1T", std::size_t{1} << 40}, {"3GiB", std::size_t{3} << 30}, {"4096", 4096},
                                 {"0", 0}}) {
    ASSERT_TRUE(ApplyAllocatorOption("host_max", v, options).ok()) << v;
    EXPECT_EQ(options.host_max_bytes, bytes) << v;
  }
}

TEST(AllocatorOptionsTest, SpillDirMustBeAnExistingDirectory) {
  AllocatorOptions options;
  absl::Status missing = ApplyAllocatorOption("spill_dir", "/nonexistent/vmstash-spill", options);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_NE(missing.message().find("'spill_dir'"), absl::string_view::npos) << missing;
  EXPECT_NE(missing.message().find("/nonexistent/vmstash-spill"), absl::string_view::npos) << missing;
  absl::Status file = ApplyAllocatorOption("spill_dir", "/proc/self/status", options);
  EXPECT_EQ(file.code(), absl::StatusCode::kNotFound) << file;
  EXPECT_NE(file.message().find("not a directory"), absl::string_view::npos) << file;
  absl::Status empty = ApplyAllocatorOption("spill_dir", "", options);
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
  EXPECT_EQ(options.spill_dir, "") << "a refused value changes nothing";
}

TEST(AllocatorOptionsTest, BadValuesNameKeyAndValue) {
  for (const auto& [k, v] : {std::pair<const char*, const char*>{"bypass", "yes"}, {"min_chunk", "0"},
                             {"max_chunk", "big"}, {"backup", "disk"}, {"auto_prepare", "2"},
                             {"switch_zero", "on"}, {"host_max", "lots"}, {"host_max", "-1G"}, {"host_max", "64X"},
                             {"host_max", "99999999999T"}}) {
    AllocatorOptions options;
    absl::Status s = ApplyAllocatorOption(k, v, options);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k << ":" << v;
    EXPECT_NE(s.message().find(absl::StrCat("'", k, "'")), absl::string_view::npos) << s;
  }
}

}  // namespace
}  // namespace vmstash
