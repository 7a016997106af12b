#include "base/bytes.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(BytesTest, HumanBytes) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1536), "1.50 KiB");
  EXPECT_EQ(HumanBytes(std::uint64_t{80} << 30), "80.00 GiB");
  EXPECT_EQ(HumanBytes(std::uint64_t{3} << 40), "3.00 TiB");
}

TEST(BytesTest, RoundUpAndHex) {
  EXPECT_EQ(RoundUp(0, 512), 0u);
  EXPECT_EQ(RoundUp(1, 512), 512u);
  EXPECT_EQ(RoundUp(512, 512), 512u);
  EXPECT_EQ(Hex(255), "0xff");
}

}  // namespace
}  // namespace vmstash
