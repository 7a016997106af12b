#include "vmm/reservation.h"

#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

constexpr std::size_t kG = 2 << 20;

TEST(ReservationTest, OwnsAndFreesItsRange) {
  SimDriver sim;
  {
    absl::StatusOr<Reservation> r = Reservation::Create(&sim, 0, 8 * kG);
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->valid());
    EXPECT_EQ(r->size_bytes(), 8 * kG);
    EXPECT_TRUE(r->Contains(r->address() + kG, 7 * kG));
    EXPECT_FALSE(r->Contains(r->address() + kG, 8 * kG));
    Reservation moved = std::move(r).value();
    EXPECT_TRUE(moved.valid());
  }
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
  EXPECT_EQ(sim.Counters().Calls(DriverOp::kFreeAddress), 1u);
}

TEST(ReservationTest, FailuresAreReturnedAndTheDestructorNeverFails) {
  SimDriver sim;
  EXPECT_EQ(Reservation::Create(&sim, 0, kG + 1).status().code(), absl::StatusCode::kInvalidArgument);
  sim.InjectFault(FaultRule{DriverOp::kReserveAddress, 1, 1, absl::StatusCode::kResourceExhausted});
  EXPECT_EQ(Reservation::Create(&sim, 0, kG).status().code(), absl::StatusCode::kResourceExhausted);
  {
    Reservation r = Reservation::Create(&sim, 0, kG).value();
    sim.InjectFault(FaultRule{DriverOp::kFreeAddress, 1, 1, absl::StatusCode::kInternal});
    EXPECT_EQ(r.Free().code(), absl::StatusCode::kInternal);
    EXPECT_TRUE(r.valid()) << "still owned after a failed Free";
  }  // the destructor retries and succeeds
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(ReservationTest, MoveAssignmentFreesTheOldRange) {
  SimDriver sim;
  Reservation a = Reservation::Create(&sim, 0, kG).value();
  Reservation b = Reservation::Create(&sim, 0, 2 * kG).value();
  a = std::move(b);
  EXPECT_EQ(a.size_bytes(), 2 * kG);
  EXPECT_EQ(sim.Counters().Calls(DriverOp::kFreeAddress), 1u);
}

}  // namespace
}  // namespace vmstash
