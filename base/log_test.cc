#include "base/log.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

std::vector<std::string>* g_lines = nullptr;
void Capture(LogLevel, absl::string_view line) { g_lines->emplace_back(line); }

int g_formatted = 0;
int Counted() { return ++g_formatted; }

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_lines = &lines_;
    SetLogSink(&Capture);
  }
  void TearDown() override {
    SetLogSink(nullptr);
    SetLogLevel(LogLevel::kWarning);
    g_lines = nullptr;
  }
  std::vector<std::string> lines_;
};

TEST_F(LogTest, LinesCarryLevelLocationAndMessage) {
  SetLogLevel(LogLevel::kInfo);
  VMSTASH_LOG(kWarning, "unmap of {:#x} failed: {}", 0x1000, absl::string_view("busy"));
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_EQ(lines_[0].rfind("[vmstash W ", 0), 0u) << lines_[0];
  EXPECT_NE(lines_[0].find("log_test.cc:"), std::string::npos) << lines_[0];
  EXPECT_NE(lines_[0].find("unmap of 0x1000 failed: busy"), std::string::npos) << lines_[0];
}

TEST_F(LogTest, DisabledLevelsAreNotEvenFormatted) {
  SetLogLevel(LogLevel::kError);
  g_formatted = 0;
  VMSTASH_LOG(kInfo, "{}", Counted());
  VMSTASH_LOG(kWarning, "{}", Counted());
  EXPECT_TRUE(lines_.empty());
  EXPECT_EQ(g_formatted, 0);
  VMSTASH_LOG(kError, "{}", Counted());
  EXPECT_EQ(lines_.size(), 1u);
  SetLogLevel(LogLevel::kOff);
  VMSTASH_LOG(kError, "silent");
  EXPECT_EQ(lines_.size(), 1u);
}

}  // namespace
}  // namespace vmstash
