#include "vmm/driver_ledger.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

constexpr std::size_t kG = 1 << 21;
constexpr DevicePtr kBase = 0x7f0000000000;

TEST(DriverLedgerTest, ValidatesSizesAndDevices) {
  EXPECT_EQ(CheckGranularSize("X", 0, kG).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckGranularSize("X", kG + 1, kG).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckGranularSize("X", 3 * kG, kG).ok());
  EXPECT_EQ(CheckGranularAddress("X", kBase + 4096, kG).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckDeviceIndex(2, 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckDeviceIndex(1, 2).ok());
}

TEST(DriverLedgerTest, ClaimsAndUndoesMappings) {
  DriverLedger ledger("test");
  ASSERT_TRUE(ledger.AddReservation(kBase, 4 * kG).ok());
  ChunkRecord record;
  record.size_bytes = 2 * kG;
  ledger.AddChunk(1, record);
  ledger.AddChunk(2, record);
  ASSERT_EQ(ledger.ClaimMap(kBase, 2 * kG, 1, kG).value().size_bytes, 2 * kG);
  EXPECT_EQ(ledger.ClaimMap(kBase + kG, 2 * kG, 2, kG).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(ledger.ClaimMap(kBase + 2 * kG, 2 * kG, 2, kG).ok());
  EXPECT_TRUE(ledger.CheckMapped(kBase, 4 * kG).ok());
  EXPECT_EQ(ledger.CheckAccessible(kBase, kG, 0).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(ledger.GrantAccess(kBase, 4 * kG, 0).ok());
  EXPECT_TRUE(ledger.CheckAccessible(kBase + 100, 4 * kG - 100, 0).ok());
  EXPECT_EQ(ledger.CheckAccessible(kBase, kG, 1).code(), absl::StatusCode::kInvalidArgument);
  // A backend failure after the claim is undone exactly.
  absl::StatusOr<MappingRecord> taken = ledger.ClaimUnmap(kBase + 2 * kG, 2 * kG);
  ASSERT_TRUE(taken.ok());
  EXPECT_EQ(ledger.CheckMapped(kBase, 4 * kG).code(), absl::StatusCode::kInvalidArgument);
  ledger.AbortUnmap(*taken);
  EXPECT_TRUE(ledger.CheckAccessible(kBase, 4 * kG, 0).ok());
  // Release while mapped keeps the record until the last unmap.
  auto released = ledger.ReleaseChunk(1);
  ASSERT_TRUE(released.ok());
  EXPECT_FALSE(released->second);
  EXPECT_EQ(ledger.GetChunk(1).status().code(), absl::StatusCode::kInvalidArgument);
  taken = ledger.ClaimUnmap(kBase, 2 * kG);
  ASSERT_TRUE(taken.ok());
  auto [gone, gone_record] = ledger.CommitUnmap(*taken);
  EXPECT_TRUE(gone);
  EXPECT_EQ(gone_record.size_bytes, 2 * kG);
  EXPECT_EQ(ledger.TakeReservation(kBase, 4 * kG).code(), absl::StatusCode::kFailedPrecondition);
  taken = ledger.ClaimUnmap(kBase + 2 * kG, 2 * kG);
  ASSERT_TRUE(taken.ok());
  EXPECT_FALSE(ledger.CommitUnmap(*taken).first);
  ASSERT_TRUE(ledger.ReleaseChunk(2).ok());
  ASSERT_TRUE(ledger.TakeReservation(kBase, 4 * kG).ok());
  EXPECT_TRUE(ledger.CheckNoLeaks().ok()) << ledger.CheckNoLeaks();
}

TEST(DriverLedgerTest, ReportsLeaks) {
  DriverLedger ledger("test");
  ledger.AddHostAlloc(reinterpret_cast<void*>(0x1000), 10);
  ledger.AddEvent(reinterpret_cast<Event>(0x2000), 0);
  absl::Status leaks = ledger.CheckNoLeaks();
  EXPECT_EQ(leaks.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(leaks.message().find("1 pinned host allocation(s)"), absl::string_view::npos);
  EXPECT_NE(leaks.message().find("1 event(s)"), absl::string_view::npos);
  EXPECT_EQ(ledger.TakeEvent(reinterpret_cast<Event>(0x2000), 1).code(), absl::StatusCode::kInvalidArgument)
      << "wrong device";
}

}  // namespace
}  // namespace vmstash
