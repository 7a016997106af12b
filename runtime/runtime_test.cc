// Runtime on the simulated driver: the tag registry applied to present and future
// allocators, all-or-nothing transitions over devices (with fault injection), devices
// never used staying untouched, and the control service's answers.
#include "runtime/runtime.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

#include "base/byte_pattern.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/control_service.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kBlock = std::size_t{3} << 20;

struct Fixture {
  SimDriver* sim = nullptr;  // owned by the runtime
  std::unique_ptr<Runtime> rt;
};

Fixture Make(int devices) {
  Fixture f;
  auto sim = std::make_unique<SimDriver>(SimDriverOptions{devices, std::size_t{1} << 30, std::size_t{2} << 20, {}});
  f.sim = sim.get();
  AllocatorOptions options;
  options.auto_prepare = false;
  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(std::move(sim), options);
  EXPECT_TRUE(rt.ok()) << rt.status();
  f.rt = *std::move(rt);
  return f;
}

TagId Tag(const char* name) { return InternTag(name).value(); }

// A block of `tag` on `device` filled with `seed`.
DevicePtr Filled(Runtime& rt, int device, TagId tag, unsigned char seed) {
  CachingAllocator* a = rt.Allocator(device).value();
  DevicePtr p = a->Allocate(kBlock, Stream{}, tag).value();
  FillPattern(p, kBlock, seed);
  return p;
}
bool Holds(DevicePtr p, unsigned char seed) { return WrongBytes(p, kBlock, seed) == 0; }

TEST(RuntimeTest, ANullDriverIsRefused) {
  EXPECT_EQ(Runtime::Create(nullptr, AllocatorOptions{}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RuntimeTest, DeclaredTagsReachPresentAndFutureAllocators) {
  Fixture f = Make(2);
  ASSERT_TRUE(f.rt->Allocator(0).ok());
  ASSERT_TRUE(f.rt->CreateTag(Tag("rt_w"), Policy::kBackup).ok());
  ASSERT_TRUE(f.rt->CreateTag(Tag("rt_kv"), Policy::kDiscard).ok());
  EXPECT_TRUE(f.rt->CreateTag(Tag("rt_w"), Policy::kBackup).ok()) << "idempotent for the same policy";
  absl::Status other = f.rt->CreateTag(Tag("rt_w"), Policy::kDiscard);
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other.message()), HasSubstr("already exists with policy backup"));
  EXPECT_EQ(f.rt->AllocatorInUse(1), nullptr);
  CachingAllocator* later = f.rt->Allocator(1).value();
  for (CachingAllocator* a : {f.rt->AllocatorInUse(0), later}) {
    EXPECT_EQ(a->TagPolicy(Tag("rt_w")).value(), Policy::kBackup) << "device " << a->device();
    EXPECT_EQ(a->TagPolicy(Tag("rt_kv")).value(), Policy::kDiscard) << "device " << a->device();
  }
  EXPECT_EQ(f.rt->Tags(), (std::vector<std::pair<TagId, Policy>>{{Tag("rt_w"), Policy::kBackup},
                                                                  {Tag("rt_kv"), Policy::kDiscard}}));
  EXPECT_EQ(f.rt->TagPolicy(Tag("rt_w")), Policy::kBackup);
  EXPECT_FALSE(f.rt->TagPolicy(Tag("rt_never")).has_value());
}

// A stats or snapshot query about a device the process never used starts nothing there
// (no allocator, no CUDA context: a rank of a job asking about another rank's GPU), and an
// agreed switch on the device in use still sees one device.
TEST(RuntimeTest, AQueryAboutAnUnusedDeviceCreatesNothingThere) {
  Fixture f = Make(2);
  ASSERT_TRUE(f.rt->CreateTag(Tag("rt_q"), Policy::kBackup).ok());
  DevicePtr p = Filled(*f.rt, 1, Tag("rt_q"), 7);
  for (bool snapshot : {false, true}) {
    absl::StatusOr<std::string> json = snapshot ? f.rt->SnapshotJson(0) : f.rt->StatsJson(0);
    ASSERT_TRUE(json.ok()) << json.status();
    EXPECT_THAT(*json, HasSubstr("\"device\":0"));
    EXPECT_THAT(*json, ::testing::Not(HasSubstr("rt_q")));
  }
  EXPECT_EQ(f.rt->AllocatorInUse(0), nullptr);
  int calls = 0;
  absl::StatusOr<bool> changed = f.rt->AgreedSwitch({Tag("rt_q")}, {}, Runtime::kAllDevices, nullptr,
                                                    [&](const absl::Status& local) {
                                                      ++calls;
                                                      return local;
                                                    });
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(f.rt->Resume(Tag("rt_q"), 1).ok());
  EXPECT_TRUE(Holds(p, 7));
}

// A rank whose process used a second device for something else: its switch's tags exist
// there too (every declared tag exists on every allocator), holding nothing; the agreed
// switch takes the device where they hold memory. Tags holding memory on two devices are
// refused before anything changes, the agreement told so.
TEST(RuntimeTest, AnAgreedSwitchTakesTheDeviceWhereItsTagsHoldMemory) {
  Fixture f = Make(2);
  ASSERT_TRUE(f.rt->CreateTag(Tag("rt_a1"), Policy::kBackup).ok());
  ASSERT_TRUE(f.rt->CreateTag(Tag("rt_a0"), Policy::kBackup).ok());
  DevicePtr on1 = Filled(*f.rt, 1, Tag("rt_a1"), 3);
  DevicePtr on0 = Filled(*f.rt, 0, Tag("rt_a0"), 4);
  auto yes = [](const absl::Status& local) { return local; };
  absl::StatusOr<bool> changed = f.rt->AgreedSwitch({Tag("rt_a1")}, {}, Runtime::kAllDevices, nullptr, yes);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  ASSERT_TRUE(f.rt->Resume(Tag("rt_a1"), 1).ok());
  EXPECT_TRUE(Holds(on1, 3));
  DevicePtr also0 = Filled(*f.rt, 0, Tag("rt_a1"), 5);
  absl::Status told;
  changed = f.rt->AgreedSwitch({Tag("rt_a1")}, {}, Runtime::kAllDevices, nullptr, [&](const absl::Status& local) {
    told = local;
    return local;
  });
  EXPECT_EQ(changed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(changed.status().message()), HasSubstr("have memory on devices 0 and 1"));
  EXPECT_EQ(told.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Holds(on1, 3) && Holds(also0, 5) && Holds(on0, 4));
}

// A tag allocated in on one device before it was declared exists there with policy
// discard; declaring it backup then fails on every device or none.
TEST(RuntimeTest, ADeclarationThatOneDeviceRefusesChangesNoDevice) {
  Fixture f = Make(2);
  ASSERT_TRUE(f.rt->Allocator(0).ok());
  const TagId tag = Tag("rt_used_first");
  const DevicePtr p = Filled(*f.rt, 1, tag, 9);
  absl::Status declared = f.rt->CreateTag(tag, Policy::kBackup);
  EXPECT_EQ(declared.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(declared.message()), HasSubstr("already in use on device 1 with policy discard"));
  EXPECT_EQ(f.rt->AllocatorInUse(0)->TagPolicy(tag).status().code(), absl::StatusCode::kNotFound)
      << "device 0 got no pool";
  EXPECT_FALSE(f.rt->TagPolicy(tag).has_value()) << "the registry does not know it";
  EXPECT_TRUE(f.rt->CreateTag(tag, Policy::kDiscard).ok()) << "its actual policy can be declared";
  EXPECT_TRUE(Holds(p, 9));
  ASSERT_TRUE(f.rt->AllocatorInUse(1)->Free(p).ok());
}

TEST(RuntimeTest, DropEmptyTagRemovesOnlyPoolsThatHoldNothing) {
  Fixture f = Make(1);
  CachingAllocator* a = f.rt->Allocator(0).value();
  const TagId empty = Tag("rt_drop_empty"), used = Tag("rt_drop_used");
  ASSERT_TRUE(a->CreateTag(empty, Policy::kBackup).ok());
  ASSERT_TRUE(a->CreateTag(used, Policy::kBackup).ok());
  const DevicePtr p = Filled(*f.rt, 0, used, 4);
  EXPECT_TRUE(a->DropEmptyTag(empty));
  EXPECT_EQ(a->TagPolicy(empty).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(a->DropEmptyTag(empty)) << "already gone";
  EXPECT_FALSE(a->DropEmptyTag(used)) << "holds memory";
  ASSERT_TRUE(a->Free(p).ok());
  EXPECT_FALSE(a->DropEmptyTag(used)) << "its freed chunk is still cached";
  ASSERT_TRUE(a->EmptyCache().ok());
  EXPECT_TRUE(a->Validate().ok());
}

// A tag's backup store reaches present and future allocators; a device that refuses it
// (the tag is paused there) leaves every device as it was.
TEST(RuntimeTest, ABackupStoreReachesEveryAllocatorOrNone) {
  Fixture f = Make(2);
  const TagId tag = Tag("rt_stored"), kv = Tag("rt_stored_kv");
  const BackupStore pageable{BackupStore::Kind::kPageable, ""};
  EXPECT_EQ(f.rt->SetBackupStore(tag, pageable).code(), absl::StatusCode::kNotFound) << "undeclared";
  ASSERT_TRUE(f.rt->CreateTag(tag, Policy::kBackup).ok());
  ASSERT_TRUE(f.rt->CreateTag(kv, Policy::kDiscard).ok());
  EXPECT_EQ(f.rt->SetBackupStore(kv, pageable).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.rt->SetBackupStore(tag, BackupStore{BackupStore::Kind::kDisk, "/nonexistent/vmstash"}).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(f.rt->TagBackupStore(tag), BackupStore{}) << "the options' default";
  const DevicePtr p0 = Filled(*f.rt, 0, tag, 1);
  ASSERT_TRUE(f.rt->SetBackupStore(tag, pageable).ok());
  EXPECT_EQ(f.rt->TagBackupStore(tag), pageable);
  EXPECT_EQ(f.rt->AllocatorInUse(0)->TagBackupStore(tag).value(), pageable);
  const DevicePtr p1 = Filled(*f.rt, 1, tag, 2);  // device 1's allocator is made now
  EXPECT_EQ(f.rt->AllocatorInUse(1)->TagBackupStore(tag).value(), pageable);
  // Device 1 paused: setting pinned is refused there and undone on device 0.
  ASSERT_TRUE(f.rt->Pause(tag, 1).value());
  absl::Status refused = f.rt->SetBackupStore(tag, BackupStore{});
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_EQ(f.rt->AllocatorInUse(0)->TagBackupStore(tag).value(), pageable);
  EXPECT_EQ(f.rt->TagBackupStore(tag), pageable);
  ASSERT_TRUE(f.rt->Resume(tag, 1).value());
  // A disk directory that disappears: the pause fails (its NotFound is not taken for "no
  // memory here") and no device is left paused.
  char dir[] = "/tmp/vmstash_rt_store_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  ASSERT_TRUE(f.rt->SetBackupStore(tag, BackupStore{BackupStore::Kind::kDisk, dir}).ok());
  ASSERT_EQ(rmdir(dir), 0);
  absl::StatusOr<bool> gone = f.rt->Pause(tag, Runtime::kAllDevices);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  EXPECT_THAT(gone.status().message(), HasSubstr(dir));
  for (int d = 0; d < 2; ++d) {
    for (const TagStats& t : f.rt->AllocatorInUse(d)->Stats().tags) {
      if (t.name == "rt_stored") {
        EXPECT_EQ(t.state, "active") << "device " << d;
      }
    }
  }
  ASSERT_TRUE(f.rt->SetBackupStore(tag, pageable).ok());
  ASSERT_TRUE(f.rt->Pause(tag, Runtime::kAllDevices).value());
  ASSERT_TRUE(f.rt->Resume(tag, Runtime::kAllDevices).value());
  EXPECT_TRUE(Holds(p0, 1));
  EXPECT_TRUE(Holds(p1, 2));
  ASSERT_TRUE(f.rt->AllocatorInUse(0)->Free(p0).ok());
  ASSERT_TRUE(f.rt->AllocatorInUse(1)->Free(p1).ok());
}

// SetBackupStore waits for the tag's transition (an agreed switch waiting for its
// agreement) without the runtime's lock: another thread's runtime calls are answered
// meanwhile (before, they waited for the whole transition), and the store is set once the
// transition ends.
TEST(RuntimeTest, ASetBackupStoreWaitingForATransitionBlocksNoOtherCall) {
  Fixture f = Make(1);
  const TagId tag = Tag("rt_waited"), other = Tag("rt_waited_other");
  const BackupStore pageable{BackupStore::Kind::kPageable, ""};
  ASSERT_TRUE(f.rt->CreateTag(tag, Policy::kBackup).ok());
  ASSERT_TRUE(f.rt->CreateTag(other, Policy::kBackup).ok());
  const DevicePtr p = Filled(*f.rt, 0, tag, 7);
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::thread switcher([&] {
    absl::StatusOr<bool> r = f.rt->AgreedSwitch({tag}, {}, 0, nullptr, [&](const absl::Status&) {
      entered.set_value();
      released.wait();
      return absl::AbortedError("the test rolls it back");
    });
    EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
  });
  entered.get_future().wait();  // the switch holds the tag's transition lock from here on
  absl::Status set;
  std::thread setter([&] { set = f.rt->SetBackupStore(tag, pageable); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the setter is waiting (or about to)
  std::future<std::optional<Policy>> answered =
      std::async(std::launch::async, [&] { return f.rt->TagPolicy(other); });
  const bool in_time = answered.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  EXPECT_TRUE(in_time) << "a runtime call waited for another tag's transition";
  release.set_value();
  switcher.join();
  setter.join();
  if (in_time) EXPECT_EQ(answered.get(), Policy::kBackup);
  EXPECT_TRUE(set.ok()) << set;
  EXPECT_EQ(f.rt->TagBackupStore(tag), pageable);
  EXPECT_EQ(f.rt->AllocatorInUse(0)->TagBackupStore(tag).value(), pageable);
  EXPECT_TRUE(Holds(p, 7));
  ASSERT_TRUE(f.rt->AllocatorInUse(0)->Free(p).ok());
}

// A disk store set ahead of its pauses (torch_memory_saver's directory, read at each
// pause): a directory that does not exist is taken; a device used for the first time
// afterwards gets the store; the pause that has bytes to write there fails (NotFound,
// naming it, nothing paused), one with none pauses.
TEST(RuntimeTest, ADiskStoreSetAheadIsCheckedByThePauseThatWrites) {
  Fixture f = Make(2);
  const TagId tag = Tag("rt_ahead"), empty = Tag("rt_ahead_empty");
  ASSERT_TRUE(f.rt->CreateTag(tag, Policy::kBackup).ok());
  ASSERT_TRUE(f.rt->CreateTag(empty, Policy::kBackup).ok());
  const BackupStore missing{BackupStore::Kind::kDisk, "/nonexistent/vmstash_rt_ahead"};
  EXPECT_EQ(f.rt->SetBackupStore(tag, missing).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(f.rt->SetBackupStore(tag, BackupStore{BackupStore::Kind::kDisk, ""}, false).code(),
            absl::StatusCode::kInvalidArgument)
      << "the store's shape is checked all the same";
  const DevicePtr p0 = Filled(*f.rt, 0, tag, 5);
  ASSERT_TRUE(f.rt->SetBackupStore(tag, missing, /*directory_must_exist=*/false).ok());
  ASSERT_TRUE(f.rt->SetBackupStore(empty, missing, /*directory_must_exist=*/false).ok());
  const DevicePtr p1 = Filled(*f.rt, 1, tag, 6);  // device 1's allocator is made now, with the store
  EXPECT_EQ(f.rt->AllocatorInUse(1)->TagBackupStore(tag).value(), missing);
  absl::StatusOr<bool> refused = f.rt->Pause(tag, Runtime::kAllDevices);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr(missing.directory));
  for (int d = 0; d < 2; ++d) {
    for (const TagStats& t : f.rt->AllocatorInUse(d)->Stats().tags) {
      if (t.name == "rt_ahead") EXPECT_EQ(t.state, "active") << "device " << d;
    }
  }
  EXPECT_TRUE(Holds(p0, 5) && Holds(p1, 6));
  EXPECT_TRUE(f.rt->Pause(empty, Runtime::kAllDevices).ok()) << "no bytes to write there";
  ASSERT_TRUE(f.rt->Resume(empty, Runtime::kAllDevices).ok());
  ASSERT_TRUE(f.rt->SetBackupStore(tag, BackupStore{}).ok());
  ASSERT_TRUE(f.rt->Pause(tag, Runtime::kAllDevices).value());
  ASSERT_TRUE(f.rt->Resume(tag, Runtime::kAllDevices).value());
  EXPECT_TRUE(Holds(p0, 5) && Holds(p1, 6));
  ASSERT_TRUE(f.rt->AllocatorInUse(0)->Free(p0).ok());
  ASSERT_TRUE(f.rt->AllocatorInUse(1)->Free(p1).ok());
}

TEST(RuntimeTest, HooksAndTheMarginReachAllocatorsCreatedLater) {
  Fixture f = Make(2);
  const TagId tag = Tag("rt_hooked");
  ASSERT_TRUE(f.rt->CreateTag(tag, Policy::kBackup).ok());
  int before = 0, after = 0;
  ASSERT_TRUE(f.rt
                  ->AddHooks(
                      tag, [&](TagId, int) { return ++before, absl::OkStatus(); },
                      [&](TagId, int) { return ++after, absl::OkStatus(); })
                  .ok());
  f.rt->SetMemoryMargin(std::size_t{2} << 30);  // more than the device has
  // The allocator made after the margin refuses to map; the hooks run on it.
  CachingAllocator* a = f.rt->Allocator(1).value();
  EXPECT_EQ(a->Allocate(kBlock, Stream{}, tag).status().code(), absl::StatusCode::kResourceExhausted);
  f.rt->SetMemoryMargin(0);
  const DevicePtr p = Filled(*f.rt, 1, tag, 7);
  ASSERT_TRUE(f.rt->Pause(tag, 1).value());
  ASSERT_TRUE(f.rt->Resume(tag, 1).value());
  EXPECT_EQ(before, 1);
  EXPECT_EQ(after, 1);
  EXPECT_TRUE(Holds(p, 7));
  ASSERT_TRUE(a->Free(p).ok());
}

TEST(RuntimeTest, SlotsBindOnceAndRunOut) {
  Fixture f = Make(1);
  EXPECT_EQ(f.rt->SlotTag(0), -1);
  const int s = f.rt->BindSlot(Tag("rt_slot")).value();
  EXPECT_EQ(f.rt->BindSlot(Tag("rt_slot")).value(), s);
  EXPECT_EQ(f.rt->SlotTag(s), Tag("rt_slot"));
  for (int i = 1; i < TagRegistry::kSlots; ++i) ASSERT_TRUE(f.rt->BindSlot(Tag(("rt_slot" + std::to_string(i)).c_str())).ok());
  EXPECT_EQ(f.rt->BindSlot(Tag("rt_slot_last")).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(RuntimeTest, PauseOverAllDevicesIsAllOrNothing) {
  Fixture f = Make(2);
  const TagId tag = Tag("rt_md");
  ASSERT_TRUE(f.rt->CreateTag(tag, Policy::kBackup).ok());
  const DevicePtr p0 = Filled(*f.rt, 0, tag, 11), p1 = Filled(*f.rt, 1, tag, 12);
  // Device 0's block is copied; device 1's copy fails.
  f.sim->InjectFault(FaultRule{DriverOp::kCopyToHost, 2, 1, absl::StatusCode::kInternal});
  absl::StatusOr<bool> r = f.rt->Pause(tag, Runtime::kAllDevices);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("failed on device 1"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("device 0 resumed again"));
  EXPECT_TRUE(Holds(p0, 11));
  EXPECT_TRUE(Holds(p1, 12));
  ASSERT_TRUE(f.rt->Pause(tag, Runtime::kAllDevices).value());
  EXPECT_FALSE(f.rt->Pause(tag, Runtime::kAllDevices).value()) << "already paused everywhere";
  // The resume of device 1 cannot map: device 0 is paused again, its bytes backed up again.
  f.sim->InjectFault(FaultRule{DriverOp::kMap, 2, 1, absl::StatusCode::kResourceExhausted});
  r = f.rt->Resume(tag, Runtime::kAllDevices);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("device 0 paused again"));
  ASSERT_TRUE(f.rt->Resume(tag, Runtime::kAllDevices).value());
  EXPECT_TRUE(Holds(p0, 11));
  EXPECT_TRUE(Holds(p1, 12));
  ASSERT_TRUE(f.rt->AllocatorInUse(0)->Free(p0).ok());
  ASSERT_TRUE(f.rt->AllocatorInUse(1)->Free(p1).ok());
}

TEST(RuntimeTest, SwitchOverAllDevicesIsAllOrNothing) {
  Fixture f = Make(2);
  const TagId out = Tag("rt_sw_out"), in = Tag("rt_sw_in"), only0 = Tag("rt_sw_only0");
  ASSERT_TRUE(f.rt->CreateTag(out, Policy::kBackup).ok());
  ASSERT_TRUE(f.rt->CreateTag(in, Policy::kBackup).ok());
  ASSERT_TRUE(f.rt->CreateTag(only0, Policy::kDiscard).ok());
  const DevicePtr i0 = Filled(*f.rt, 0, in, 21), i1 = Filled(*f.rt, 1, in, 22);
  ASSERT_TRUE(f.rt->Pause(in, Runtime::kAllDevices).value());
  const DevicePtr o0 = Filled(*f.rt, 0, out, 31), o1 = Filled(*f.rt, 1, out, 32);
  const DevicePtr z0 = Filled(*f.rt, 0, only0, 41);  // a tag with memory on device 0 alone
  // Device 0 switches; device 1's backup copy fails: device 0 is switched back.
  f.sim->InjectFault(FaultRule{DriverOp::kCopyToHost, 2, 1, absl::StatusCode::kInternal});
  absl::StatusOr<bool> r = f.rt->Switch({out, only0}, {in}, Runtime::kAllDevices);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("failed on device 1"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("device 0 switched back"));
  EXPECT_TRUE(Holds(o0, 31));
  EXPECT_TRUE(Holds(o1, 32));
  ASSERT_TRUE(f.rt->Switch({out, only0}, {in}, Runtime::kAllDevices).value());
  EXPECT_TRUE(Holds(i0, 21));
  EXPECT_TRUE(Holds(i1, 22));
  EXPECT_FALSE(f.rt->Switch({out, only0}, {in}, Runtime::kAllDevices).value()) << "every tag already in its state";
  ASSERT_TRUE(f.rt->Switch({in}, {out}, 1).value());  // one device
  EXPECT_TRUE(Holds(o1, 32));
  ASSERT_TRUE(f.rt->Switch({in}, {out}, 0).value());
  EXPECT_TRUE(Holds(o0, 31));
  EXPECT_EQ(f.rt->Switch({Tag("rt_sw_typo")}, {in}, Runtime::kAllDevices).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(f.rt->Switch({}, {}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(f.rt->Resume(in, Runtime::kAllDevices).value());
  ASSERT_TRUE(f.rt->Resume(only0, Runtime::kAllDevices).value());
  for (auto [d, p] : {std::pair{0, i0}, std::pair{1, i1}, std::pair{0, o0}, std::pair{1, o1}, std::pair{0, z0}}) {
    ASSERT_TRUE(f.rt->AllocatorInUse(d)->Free(p).ok());
  }
}

TEST(RuntimeTest, UnknownTagsAreNotFoundAndUnusedDevicesGetNoAllocator) {
  Fixture f = Make(2);
  ASSERT_TRUE(f.rt->Allocator(0).ok());
  EXPECT_EQ(f.rt->Pause(Tag("rt_typo"), Runtime::kAllDevices).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(f.rt->CreateTag(Tag("rt_known"), Policy::kDiscard).ok());
  EXPECT_FALSE(f.rt->Pause(Tag("rt_known"), 1).value()) << "no memory there: nothing to do";
  EXPECT_EQ(f.rt->AllocatorInUse(1), nullptr);
  EXPECT_EQ(f.rt->Pause(Tag("rt_known"), 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.rt->Allocator(64).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(f.rt->ReleaseBackup(Tag("rt_known"), Runtime::kAllDevices).ok());
}

TEST(RuntimeTest, ControlServiceAnswersFromTheRuntime) {
  Fixture f = Make(2);
  const TagId tag = Tag("rt_remote");
  ASSERT_TRUE(f.rt->CreateTag(tag, Policy::kBackup).ok());
  const DevicePtr p = Filled(*f.rt, 0, tag, 5);
  control::Request r;
  r.op = control::Op::kHello;
  absl::StatusOr<std::string> hello = HandleControlRequest(*f.rt, r);
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_THAT(*hello, HasSubstr(R"("driver":"sim","device_count":2,"devices_in_use":[0])"));
  r.op = control::Op::kStats;
  r.device = 1;
  EXPECT_EQ(HandleControlRequest(*f.rt, r).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(f.rt->AllocatorInUse(1), nullptr) << "a remote request creates no allocator";
  r.device = -1;
  absl::StatusOr<std::string> stats = HandleControlRequest(*f.rt, r);
  ASSERT_TRUE(stats.ok());
  EXPECT_THAT(*stats, HasSubstr(R"("name":"rt_remote")"));
  r.op = control::Op::kPause;
  r.tag = "rt_remote";
  EXPECT_EQ(HandleControlRequest(*f.rt, r).value(), R"({"changed":true})");
  EXPECT_EQ(HandleControlRequest(*f.rt, r).value(), R"({"changed":false})");
  r.op = control::Op::kResume;
  EXPECT_EQ(HandleControlRequest(*f.rt, r).value(), R"({"changed":true})");
  EXPECT_TRUE(Holds(p, 5));
  r.tag = "rt_nobody";
  EXPECT_EQ(HandleControlRequest(*f.rt, r).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(f.rt->AllocatorInUse(0)->Free(p).ok());
}

// The state of `tag` on `device` ("active", "paused", ...).
std::string StateOf(Runtime& rt, int device, TagId tag) {
  for (const TagStats& t : rt.AllocatorInUse(device)->Stats().tags) {
    if (t.name == TagName(tag)) return t.state;
  }
  return "absent";
}

// An after-resume hook that fails on the devices whose bit is set in `*failing`.
CachingAllocator::TransitionHook FailingAfterResume(const int* failing) {
  return [failing](TagId, int device) {
    return (*failing >> device) & 1 ? absl::DataLossError(absl::StrCat("hook refuses device ", device))
                                    : absl::OkStatus();
  };
}

// Note [All-or-Nothing Transitions] case (2): a resume whose after-resume hook fails on a
// device is done there, so every device is resumed and the error says so.
TEST(RuntimeTest, AnAfterResumeHookFailureStillResumesEveryDevice) {
  Fixture f = Make(2);
  const TagId tag = Tag("rt_hook_resume");
  ASSERT_TRUE(f.rt->CreateTag(tag, Policy::kBackup).ok());
  int failing = 0;
  ASSERT_TRUE(f.rt->AddHooks(tag, nullptr, FailingAfterResume(&failing)).ok());
  const DevicePtr p0 = Filled(*f.rt, 0, tag, 51), p1 = Filled(*f.rt, 1, tag, 52);
  for (int mask : {1, 3}) {
    SCOPED_TRACE(mask);
    ASSERT_TRUE(f.rt->Pause(tag, Runtime::kAllDevices).value());
    failing = mask;
    absl::StatusOr<bool> r = f.rt->Resume(tag, Runtime::kAllDevices);
    failing = 0;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_TRUE(Runtime::TransitionDone(r.status()));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("done on every device"));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("device 0: tag 'rt_hook_resume' resumed, but"));
    EXPECT_EQ(mask == 3, std::string(r.status().message()).find("device 1:") != std::string::npos);
    EXPECT_EQ(StateOf(*f.rt, 0, tag), "active");
    EXPECT_EQ(StateOf(*f.rt, 1, tag), "active");
    EXPECT_TRUE(Holds(p0, 51));
    EXPECT_TRUE(Holds(p1, 52));
  }
  EXPECT_FALSE(Runtime::TransitionDone(absl::OkStatus()));
  EXPECT_FALSE(Runtime::TransitionDone(absl::DataLossError("x")));
  ASSERT_TRUE(f.rt->AllocatorInUse(0)->Free(p0).ok());
  ASSERT_TRUE(f.rt->AllocatorInUse(1)->Free(p1).ok());
}

// The same for a switch: the incoming tag's hook fails on device 0; device 1 is switched too.
TEST(RuntimeTest, AnAfterResumeHookFailureStillSwitchesEveryDevice) {
  Fixture f = Make(2);
  const TagId out = Tag("rt_hook_sw_out"), in = Tag("rt_hook_sw_in");
  ASSERT_TRUE(f.rt->CreateTag(out, Policy::kBackup).ok());
  ASSERT_TRUE(f.rt->CreateTag(in, Policy::kBackup).ok());
  int failing = 0;
  ASSERT_TRUE(f.rt->AddHooks(in, nullptr, FailingAfterResume(&failing)).ok());
  const DevicePtr i0 = Filled(*f.rt, 0, in, 61), i1 = Filled(*f.rt, 1, in, 62);
  ASSERT_TRUE(f.rt->Pause(in, Runtime::kAllDevices).value());
  const DevicePtr o0 = Filled(*f.rt, 0, out, 71), o1 = Filled(*f.rt, 1, out, 72);
  failing = 1;
  absl::StatusOr<bool> r = f.rt->Switch({out}, {in}, Runtime::kAllDevices);
  failing = 0;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_TRUE(Runtime::TransitionDone(r.status()));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("done on every device"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("device 0: switch done, but"));
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(StateOf(*f.rt, d, out), "paused") << "device " << d;
    EXPECT_EQ(StateOf(*f.rt, d, in), "active") << "device " << d;
  }
  EXPECT_TRUE(Holds(i0, 61));
  EXPECT_TRUE(Holds(i1, 62));
  ASSERT_TRUE(f.rt->Switch({in}, {out}, Runtime::kAllDevices).value());
  EXPECT_TRUE(Holds(o0, 71));
  EXPECT_TRUE(Holds(o1, 72));
  ASSERT_TRUE(f.rt->Resume(in, Runtime::kAllDevices).value());
  for (auto [d, p] : {std::pair{0, i0}, std::pair{1, i1}, std::pair{0, o0}, std::pair{1, o1}}) {
    ASSERT_TRUE(f.rt->AllocatorInUse(d)->Free(p).ok());
  }
}

// Case (1) wins over case (2): a device whose hook failed is rolled back with the others
// when a later device fails the transition itself, and the error says both.
TEST(RuntimeTest, ADeviceWhoseHookFailedIsRolledBackWhenALaterDeviceFails) {
  Fixture f = Make(2);
  const TagId out = Tag("rt_hook_rb_out"), in = Tag("rt_hook_rb_in");
  ASSERT_TRUE(f.rt->CreateTag(out, Policy::kBackup).ok());
  ASSERT_TRUE(f.rt->CreateTag(in, Policy::kBackup).ok());
  int failing = 0;
  ASSERT_TRUE(f.rt->AddHooks(in, nullptr, FailingAfterResume(&failing)).ok());
  const DevicePtr i0 = Filled(*f.rt, 0, in, 81), i1 = Filled(*f.rt, 1, in, 82);
  ASSERT_TRUE(f.rt->Pause(in, Runtime::kAllDevices).value());
  // Resume: device 0 resumes (its hook fails), device 1 cannot map: device 0 paused again.
  failing = 1;
  f.sim->InjectFault(FaultRule{DriverOp::kMap, 2, 1, absl::StatusCode::kResourceExhausted});
  absl::StatusOr<bool> r = f.rt->Resume(in, Runtime::kAllDevices);
  f.sim->ClearFaults();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_FALSE(Runtime::TransitionDone(r.status()));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("failed on device 1 (the tag is paused there)"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("device 0 paused again (its after-resume hook had failed"));
  EXPECT_EQ(StateOf(*f.rt, 0, in), "paused");
  EXPECT_EQ(StateOf(*f.rt, 1, in), "paused");
  // Switch: device 0 switches (its hook fails), device 1's backup copy fails.
  const DevicePtr o0 = Filled(*f.rt, 0, out, 91), o1 = Filled(*f.rt, 1, out, 92);
  f.sim->InjectFault(FaultRule{DriverOp::kCopyToHost, 2, 1, absl::StatusCode::kInternal});
  r = f.rt->Switch({out}, {in}, Runtime::kAllDevices);
  f.sim->ClearFaults();
  failing = 0;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_FALSE(Runtime::TransitionDone(r.status()));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("switch failed on device 1"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("device 0 switched back (its after-resume hook had failed"));
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(StateOf(*f.rt, d, out), "active") << "device " << d;
    EXPECT_EQ(StateOf(*f.rt, d, in), "paused") << "device " << d;
  }
  EXPECT_TRUE(Holds(o0, 91));
  EXPECT_TRUE(Holds(o1, 92));
  ASSERT_TRUE(f.rt->Resume(in, Runtime::kAllDevices).value());
  EXPECT_TRUE(Holds(i0, 81));
  EXPECT_TRUE(Holds(i1, 82));
  for (auto [d, p] : {std::pair{0, i0}, std::pair{1, i1}, std::pair{0, o0}, std::pair{1, o1}}) {
    ASSERT_TRUE(f.rt->AllocatorInUse(d)->Free(p).ok());
  }
}

// A before-pause hook's veto on device 1 is case (1): device 0 is resumed again.
TEST(RuntimeTest, ABeforePauseVetoOnDevice1RollsDevice0Back) {
  Fixture f = Make(2);
  const TagId tag = Tag("rt_hook_veto");
  ASSERT_TRUE(f.rt->CreateTag(tag, Policy::kBackup).ok());
  ASSERT_TRUE(f.rt
                  ->AddHooks(
                      tag,
                      [](TagId, int device) {
                        return device == 1 ? absl::AbortedError("not now") : absl::OkStatus();
                      },
                      nullptr)
                  .ok());
  const DevicePtr p0 = Filled(*f.rt, 0, tag, 13), p1 = Filled(*f.rt, 1, tag, 14);
  absl::StatusOr<bool> r = f.rt->Pause(tag, Runtime::kAllDevices);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
  EXPECT_FALSE(Runtime::TransitionDone(r.status()));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("failed on device 1 (the tag is active there)"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("device 0 resumed again"));
  EXPECT_EQ(StateOf(*f.rt, 0, tag), "active");
  EXPECT_EQ(StateOf(*f.rt, 1, tag), "active");
  EXPECT_TRUE(Holds(p0, 13));
  EXPECT_TRUE(Holds(p1, 14));
  ASSERT_TRUE(f.rt->AllocatorInUse(0)->Free(p0).ok());
  ASSERT_TRUE(f.rt->AllocatorInUse(1)->Free(p1).ok());
}

// Per-device liveness hints in one call: each device copies only its own hinted bytes.
TEST(RuntimeTest, APauseTakesEachDevicesOwnHint) {
  Fixture f = Make(2);
  const TagId tag = Tag("rt_hinted");
  ASSERT_TRUE(f.rt->CreateTag(tag, Policy::kBackup).ok());
  const DevicePtr p0 = Filled(*f.rt, 0, tag, 23), p1 = Filled(*f.rt, 1, tag, 24);
  Runtime::LiveRangesByDevice live;
  live[0][tag] = {{p0, 4096}};
  live[1][tag] = {{p1 + 8192, 3 * 4096}};
  ASSERT_TRUE(f.rt->Pause(tag, Runtime::kAllDevices, live).value());
  EXPECT_EQ(f.rt->AllocatorInUse(0)->Stats().total.backed_up_bytes, 4096);
  EXPECT_EQ(f.rt->AllocatorInUse(1)->Stats().total.backed_up_bytes, 3 * 4096);
  ASSERT_TRUE(f.rt->Resume(tag, Runtime::kAllDevices).value());
  EXPECT_EQ(WrongBytes(p0, 4096, 23), 0u);
  ASSERT_TRUE(f.rt->AllocatorInUse(0)->Free(p0).ok());
  ASSERT_TRUE(f.rt->AllocatorInUse(1)->Free(p1).ok());
}

}  // namespace
}  // namespace vmstash
