#include "allocator/handoff_plan.h"

#include <map>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

constexpr std::size_t kG = std::size_t{2} << 20;  // granule

// Every recipient tiled exactly, every donor used at most once and only where allowed.
void ExpectValid(const std::vector<HandoffDonor>& donors, const std::vector<HandoffRecipient>& recipients,
                 const HandoffPlan& plan) {
  ASSERT_EQ(plan.pieces.size(), recipients.size());
  std::map<int, int> uses;
  std::size_t handed = 0, fresh = 0, leftover = 0;
  for (std::size_t r = 0; r < recipients.size(); ++r) {
    std::size_t sum = 0;
    for (const HandoffPiece& p : plan.pieces[r]) {
      EXPECT_GT(p.size_bytes, 0u);
      EXPECT_EQ(p.size_bytes % kG, 0u);
      sum += p.size_bytes;
      if (p.donor >= 0) {
        ++uses[p.donor];
        EXPECT_EQ(p.size_bytes, donors[p.donor].size_bytes);
        EXPECT_TRUE(donors[p.donor].backed_up || !recipients[r].restores)
            << "a discard donor went to a restoring recipient";
        handed += p.size_bytes;
      } else {
        fresh += p.size_bytes;
      }
    }
    ASSERT_EQ(plan.overhang.size(), recipients.size());
    EXPECT_EQ(sum, recipients[r].size_bytes + plan.overhang[r]) << "recipient " << r;
    if (plan.overhang[r] > 0) EXPECT_LT(plan.overhang[r], recipients[r].slack_bytes) << "touches what follows";
    EXPECT_LE(plan.overhang[r], recipients[r].size_bytes / 16);
    if (plan.overhang[r] > 0) {  // only the last piece, a donor, runs past the end
      EXPECT_GE(plan.pieces[r].back().donor, 0);
      EXPECT_GT(plan.pieces[r].back().size_bytes, plan.overhang[r]);
    }
  }
  for (int d : plan.leftover) {
    ++uses[d];
    leftover += donors[d].size_bytes;
  }
  for (std::size_t d = 0; d < donors.size(); ++d) EXPECT_EQ(uses[static_cast<int>(d)], 1) << "donor " << d;
  EXPECT_EQ(plan.handed_bytes, handed);
  EXPECT_EQ(plan.fresh_bytes, fresh);
  EXPECT_EQ(plan.leftover_bytes, leftover);
}

TEST(PlanHandoffTest, SameSizesHandEverythingOver) {
  std::vector<HandoffDonor> donors = {{512 * kG, true}, {256 * kG, true}};
  std::vector<HandoffRecipient> recipients = {{768 * kG, true}};
  HandoffPlan plan = PlanHandoff(donors, recipients, 32 * kG, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  EXPECT_EQ(plan.handed_bytes, 768 * kG);
  EXPECT_EQ(plan.fresh_bytes, 0u);
  EXPECT_TRUE(plan.leftover.empty());
  EXPECT_EQ(plan.pieces[0], (std::vector<HandoffPiece>{{512 * kG, 0}, {256 * kG, 1}}));
}

TEST(PlanHandoffTest, IncomingNeedsMoreTheRestIsCreated) {
  std::vector<HandoffDonor> donors = {{8 * kG, true}};
  std::vector<HandoffRecipient> recipients = {{20 * kG, true}};
  HandoffPlan plan = PlanHandoff(donors, recipients, 0, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  EXPECT_EQ(plan.handed_bytes, 8 * kG);
  EXPECT_EQ(plan.fresh_bytes, 12 * kG);
  EXPECT_EQ(plan.pieces[0], (std::vector<HandoffPiece>{{8 * kG, 0}, {12 * kG, -1}}));
}

TEST(PlanHandoffTest, IncomingNeedsLessTheRestIsReleased) {
  std::vector<HandoffDonor> donors = {{8 * kG, true}, {4 * kG, false}, {2 * kG, true}};
  std::vector<HandoffRecipient> recipients = {{10 * kG, false}};
  HandoffPlan plan = PlanHandoff(donors, recipients, 0, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  // The discard donor goes first (it has fewer places to go), then the largest that fits.
  EXPECT_EQ(plan.pieces[0], (std::vector<HandoffPiece>{{4 * kG, 1}, {2 * kG, 2}, {4 * kG, -1}}));
  EXPECT_EQ(plan.leftover, std::vector<int>{0});
  EXPECT_EQ(plan.leftover_bytes, 8 * kG);
}

TEST(PlanHandoffTest, DiscardDonorsNeverReachRestoringRecipients) {
  std::vector<HandoffDonor> donors = {{4 * kG, false}, {4 * kG, true}};
  std::vector<HandoffRecipient> recipients = {{4 * kG, true}, {4 * kG, false}};
  HandoffPlan plan = PlanHandoff(donors, recipients, 0, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  EXPECT_EQ(plan.pieces[0], (std::vector<HandoffPiece>{{4 * kG, 1}}));
  EXPECT_EQ(plan.pieces[1], (std::vector<HandoffPiece>{{4 * kG, 0}}));
  EXPECT_EQ(plan.fresh_bytes, 0u);
}

TEST(PlanHandoffTest, ALastDonorMayOverhangIntoTheSlackInsteadOfFreshPlusLeftover) {
  // 64 granules to fill: 40 + 20 fit, 4 remain; the 6-granule donor covers them with 2 to
  // spare, within 64 / 16 = 4 granules: no fresh piece, no leftover.
  std::vector<HandoffDonor> donors = {{40 * kG, true}, {20 * kG, true}, {6 * kG, true}};
  std::vector<HandoffRecipient> recipients = {{64 * kG, true, 100 * kG}};
  HandoffPlan plan = PlanHandoff(donors, recipients, 0, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  EXPECT_EQ(plan.overhang[0], 2 * kG);
  EXPECT_EQ(plan.fresh_bytes, 0u);
  EXPECT_TRUE(plan.leftover.empty());
  // Without slack, or past 1/16 of the recipient, the remainder is created instead.
  recipients[0].slack_bytes = kG;
  plan = PlanHandoff(donors, recipients, 0, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  EXPECT_EQ(plan.overhang[0], 0u);
  EXPECT_EQ(plan.fresh_bytes, 4 * kG);
  EXPECT_EQ(plan.leftover, std::vector<int>{2});
  donors[2].size_bytes = 10 * kG;  // 6 granules over: more than 64 / 16
  recipients[0].slack_bytes = 100 * kG;
  plan = PlanHandoff(donors, recipients, 0, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  EXPECT_EQ(plan.overhang[0], 0u);
}

// Issue 28 item 5: an overhang that fills the slack exactly makes the cover touch the
// next one (two run heads over one run of chunks). The slack must keep a granule free.
TEST(PlanHandoffTest, AnOverhangNeverFillsTheWholeSlack) {
  std::vector<HandoffDonor> donors = {{34 * kG, false}};
  std::vector<HandoffRecipient> recipients = {{32 * kG, false, 2 * kG}, {4 * kG, false, 0}};
  HandoffPlan plan = PlanHandoff(donors, recipients, 0, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  EXPECT_EQ(plan.overhang[0], 0u);
  EXPECT_EQ(plan.leftover, std::vector<int>{0});
  // One granule more of slack: the donor may overhang by 2 and leave one free.
  recipients[0].slack_bytes = 3 * kG;
  plan = PlanHandoff(donors, recipients, 0, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  EXPECT_EQ(plan.overhang[0], 2 * kG);
  EXPECT_TRUE(plan.leftover.empty());
}

TEST(PlanHandoffTest, BestFitKeepsLargeGapsForLargeDonors) {
  std::vector<HandoffDonor> donors = {{6 * kG, true}, {3 * kG, true}};
  std::vector<HandoffRecipient> recipients = {{6 * kG, false}, {3 * kG, false}};
  HandoffPlan plan = PlanHandoff(donors, recipients, 0, 1024 * kG, kG);
  ExpectValid(donors, recipients, plan);
  EXPECT_EQ(plan.handed_bytes, 9 * kG);
}

TEST(PlanHandoffTest, FreshRemaindersArePiecedForRestoringRecipients) {
  std::vector<HandoffRecipient> recipients = {{64 * kG, true}, {64 * kG, false}};
  HandoffPlan plan = PlanHandoff({}, recipients, 4 * kG, 32 * kG, kG);
  ExpectValid({}, recipients, plan);
  EXPECT_GT(plan.pieces[0].size(), 1u);  // pieces growing from 4 granules
  EXPECT_EQ(plan.pieces[0].front().size_bytes, 4 * kG);
  EXPECT_EQ(plan.pieces[1].size(), 1u);  // nothing to overlap: one chunk
}

TEST(PlanHandoffTest, RandomPlansAreValid) {
  std::uint64_t x = 12345;
  auto next = [&]() { return x = x * 6364136223846793005ull + 1442695040888963407ull, x >> 33; };
  for (int round = 0; round < 300; ++round) {
    std::vector<HandoffDonor> donors(next() % 12);
    for (auto& d : donors) d = {(1 + next() % 40) * kG, next() % 2 == 0};
    std::vector<HandoffRecipient> recipients(next() % 8);
    for (auto& r : recipients) r = {(1 + next() % 80) * kG, next() % 2 == 0, (next() % 8) * kG};
    HandoffPlan plan = PlanHandoff(donors, recipients, (next() % 4) * kG, (1 + next() % 64) * kG, kG);
    ExpectValid(donors, recipients, plan);
  }
}

TEST(OpenGapsTest, TheFreshBytesOfEachCoverRestoringOnesStrict) {
  std::vector<HandoffDonor> donors = {{8 * kG, true}};
  std::vector<HandoffRecipient> recipients = {
      {4 * kG, true, 0},         // restores: a strict gap (only chunks their giver backed up)
      {32 * kG, false, 4 * kG},  // 8 from the donor, 24 fresh; may be overrun by 2 (32 / 16)
      {6 * kG, false, kG},       // fresh, no room after it
  };
  HandoffPlan plan = PlanHandoff(donors, recipients, kG, 64 * kG, kG);
  const HandoffGaps open = OpenGaps(plan, recipients, kG, 8);
  ASSERT_EQ(open.gaps.size(), 3u);
  EXPECT_EQ(open.recipient, (std::vector<std::size_t>{0, 1, 2}));
  EXPECT_EQ(open.gaps[0].size_bytes, 4 * kG);
  EXPECT_TRUE(open.gaps[0].strict);
  EXPECT_EQ(open.gaps[1].size_bytes, 24 * kG);
  EXPECT_EQ(open.gaps[1].max_overhang_bytes, 2 * kG);
  EXPECT_FALSE(open.gaps[1].strict);
  EXPECT_EQ(open.gaps[2].size_bytes, 6 * kG);
  EXPECT_EQ(open.gaps[2].max_overhang_bytes, 0u);
  EXPECT_FALSE(open.gaps[2].strict);
  // Without the restoring covers (the device has the memory for them).
  const HandoffGaps discard_only = OpenGaps(plan, recipients, kG, 8, /*restoring=*/false);
  EXPECT_EQ(discard_only.recipient, (std::vector<std::size_t>{1, 2}));
  // At most one: the largest.
  const HandoffGaps one = OpenGaps(plan, recipients, kG, 1);
  ASSERT_EQ(one.gaps.size(), 1u);
  EXPECT_EQ(one.recipient, (std::vector<std::size_t>{1}));
  EXPECT_EQ(OpenGaps(plan, recipients, kG, 0).gaps.size(), 0u);
}

TEST(OpenGapsTest, RestoringCoversTakeOtherProcessesChunksOnlyWhenMemoryIsShort) {
  EXPECT_FALSE(RestoresTakeForeignChunks(8 * kG, 9 * kG));
  EXPECT_TRUE(RestoresTakeForeignChunks(8 * kG, 8 * kG)) << "an eighth of headroom";
  EXPECT_TRUE(RestoresTakeForeignChunks(8 * kG, 2 * kG));
  EXPECT_TRUE(RestoresTakeForeignChunks(8 * kG, std::nullopt)) << "unknown: take";
  EXPECT_FALSE(RestoresTakeForeignChunks(0, 0));
}

TEST(OpenGapsTest, TheLargestGapsKeptInRecipientOrder) {
  std::vector<HandoffRecipient> recipients;
  for (std::size_t g : {2, 6, 4, 6, 8}) recipients.push_back({g * kG, false, 0});
  const HandoffPlan plan = PlanHandoff({}, recipients, kG, 64 * kG, kG);
  const HandoffGaps open = OpenGaps(plan, recipients, kG, 3);
  EXPECT_EQ(open.recipient, (std::vector<std::size_t>{1, 3, 4}));  // 6 and 6 (the earlier ties), 8
}

TEST(AddForeignDonorsTest, OtherProcessesChunksFillTheOpenGapsByTheSameRule) {
  std::vector<HandoffRecipient> recipients = {{32 * kG, false, 4 * kG}, {8 * kG, true, 0}};
  HandoffPlan plan = PlanHandoff({}, recipients, kG, 64 * kG, kG);
  const HandoffGaps open = OpenGaps(plan, recipients, kG, 8);
  // 40 fits nowhere; 16 and 10 fit whole; 8 closes the last 6 by overrunning 2. None may
  // go where restore copies write: the restoring cover keeps its fresh memory.
  const std::vector<FitChunk> foreign = {{16 * kG, false}, {8 * kG, false}, {10 * kG, false}, {40 * kG, false}};
  const std::vector<int> unused = AddForeignDonors(plan, open, foreign, 0, kG, 64 * kG, kG);
  EXPECT_EQ(unused, (std::vector<int>{3}));
  EXPECT_EQ(plan.pieces[0], (std::vector<HandoffPiece>{{16 * kG, 0}, {10 * kG, 2}, {8 * kG, 1}}));
  EXPECT_EQ(plan.overhang[0], 2 * kG);
  EXPECT_EQ(plan.handed_bytes, 34 * kG);
  EXPECT_EQ(plan.fresh_bytes, 8 * kG);  // the restoring cover's own, untouched
  EXPECT_EQ(plan.leftover, (std::vector<int>{3})) << "released at the commit";
  EXPECT_EQ(plan.leftover_bytes, 40 * kG);
  std::vector<HandoffDonor> all;
  for (const FitChunk& f : foreign) all.push_back({f.size_bytes, false});
  ExpectValid(all, recipients, plan);
}

TEST(AddForeignDonorsTest, BackedUpChunksGoWhereRestoreCopiesWrite) {
  std::vector<HandoffRecipient> recipients = {{8 * kG, false, 0}, {12 * kG, true, 0}};
  HandoffPlan plan = PlanHandoff({}, recipients, 2 * kG, 64 * kG, kG);
  const HandoffGaps open = OpenGaps(plan, recipients, kG, 8);
  // The discard tag's chunks are placed first (they have fewer places to go): the 8 fills
  // the discard cover, the 4 fits nowhere else; the 12 backed up fills the restoring one.
  const std::vector<FitChunk> foreign = {{8 * kG, false}, {12 * kG, true}, {4 * kG, false}};
  const std::vector<int> unused = AddForeignDonors(plan, open, foreign, 0, 2 * kG, 64 * kG, kG);
  EXPECT_EQ(plan.pieces[0], (std::vector<HandoffPiece>{{8 * kG, 0}}));
  EXPECT_EQ(plan.pieces[1], (std::vector<HandoffPiece>{{12 * kG, 1}}));
  EXPECT_EQ(unused, (std::vector<int>{2})) << "a discard tag's chunk never goes into a restoring cover";
  // A restoring cover's gap left partly open is cut as a resume cuts it: its first piece.
  const std::vector<HandoffRecipient> restoring = {{12 * kG, true, 0}};
  HandoffPlan partly = PlanHandoff({}, restoring, 2 * kG, 64 * kG, kG);
  const std::vector<int> left =
      AddForeignDonors(partly, OpenGaps(partly, restoring, kG, 8), {{4 * kG, true}}, 0, 2 * kG, 64 * kG, kG);
  EXPECT_TRUE(left.empty());
  std::vector<HandoffPiece> expected = {{4 * kG, 0}};
  for (std::size_t size : PlanPieces(8 * kG, 2 * kG, 64 * kG, kG)) expected.push_back({size, kNoDonor});
  EXPECT_EQ(partly.pieces[0], expected);
  EXPECT_EQ(expected[1].size_bytes, 2 * kG);
  std::vector<HandoffDonor> all = {{8 * kG, false}, {12 * kG, true}, {4 * kG, false}};
  ExpectValid(all, recipients, plan);
}

// A plan with this process's donors, then other processes' chunks added: still a valid
// plan over both (a foreign chunk counts as backed up when its giver can restore it, else
// as a discard donor), and the own donors' placement is unchanged.
TEST(AddForeignDonorsTest, RandomAdditionsKeepThePlanValid) {
  std::uint64_t x = 99;
  auto next = [&]() { return x = x * 6364136223846793005ull + 1442695040888963407ull, x >> 33; };
  for (int round = 0; round < 300; ++round) {
    std::vector<HandoffDonor> donors(next() % 8);
    for (auto& d : donors) d = {(1 + next() % 40) * kG, next() % 2 == 0};
    std::vector<HandoffRecipient> recipients(next() % 8);
    for (auto& r : recipients) r = {(1 + next() % 80) * kG, next() % 2 == 0, (next() % 8) * kG};
    HandoffPlan plan = PlanHandoff(donors, recipients, (next() % 4) * kG, (1 + next() % 64) * kG, kG);
    const HandoffPlan before = plan;
    std::vector<FitChunk> foreign(next() % 10);
    for (auto& f : foreign) f = {(1 + next() % 40) * kG, next() % 2 == 0};
    const int first = static_cast<int>(donors.size());
    const std::vector<int> unused = AddForeignDonors(plan, OpenGaps(plan, recipients, kG, 1 + next() % 8), foreign,
                                                     first, (next() % 4) * kG, (1 + next() % 64) * kG, kG);
    std::vector<HandoffDonor> all = donors;
    for (const FitChunk& f : foreign) all.push_back({f.size_bytes, f.anywhere});
    for (int f : unused) EXPECT_GE(f, first);
    ExpectValid(all, recipients, plan);
    for (std::size_t r = 0; r < recipients.size(); ++r) {
      std::vector<HandoffPiece> own_before, own_after;
      for (const HandoffPiece& p : before.pieces[r]) {
        if (p.donor != kNoDonor) own_before.push_back(p);
      }
      for (const HandoffPiece& p : plan.pieces[r]) {
        if (p.donor != kNoDonor && p.donor < first) own_after.push_back(p);
      }
      EXPECT_EQ(own_before, own_after) << "recipient " << r;
    }
  }
}

TEST(PlanSwitchCopiesTest, CutAtChunksAndGrouped) {
  const DevicePtr base = 1ull << 40;
  std::vector<ChunkSpan> chunks = {{base, 4 * kG}, {base + 4 * kG, 4 * kG}};
  // One extent across both chunks, one inside the second.
  std::vector<BackupExtent> extents = {{base + kG, 5 * kG, 0}, {base + 7 * kG, kG / 2, 5 * kG}};
  absl::StatusOr<std::vector<SwitchCopy>> copies = PlanSwitchCopies(extents, chunks, 4 * kG, 3);
  ASSERT_TRUE(copies.ok()) << copies.status();
  ASSERT_EQ(copies->size(), 3u);
  EXPECT_EQ((*copies)[0].step, (CopyStep{base + kG, 0, 3 * kG}));
  EXPECT_EQ((*copies)[0].chunk, 0u);
  EXPECT_EQ((*copies)[0].group, 3u);
  EXPECT_EQ((*copies)[1].step, (CopyStep{base + 4 * kG, 3 * kG, 2 * kG}));
  EXPECT_EQ((*copies)[1].chunk, 1u);
  EXPECT_EQ((*copies)[1].group, 3u);  // the group closes after 5 granules
  EXPECT_EQ((*copies)[2].group, 4u);
  EXPECT_EQ((*copies)[2].step.arena_offset, 5 * kG);

  std::vector<BackupExtent> outside = {{base + 9 * kG, kG, 0}};
  EXPECT_EQ(PlanSwitchCopies(outside, chunks, kG, 0).status().code(), absl::StatusCode::kInternal);
}

TEST(CopyReadinessTest, WaitsOnlyForTheReadsItOverwrites) {
  const DevicePtr base = 1ull << 40;
  std::vector<SwitchCopy> copies = {{{base, 0, kG}, 0, 0},
                                    {{base + kG, kG, kG}, 0, 1},
                                    {{base + 3 * kG, 2 * kG, kG}, 0, 2},
                                    {{base + 8 * kG, 3 * kG, kG}, 1, 2}};
  CopyReadiness r(copies, 3);
  EXPECT_EQ(r.WaitGroup(0, base, kG), std::optional<std::size_t>(0));
  EXPECT_EQ(r.WaitGroup(0, base + kG / 2, kG), std::optional<std::size_t>(1));
  EXPECT_EQ(r.WaitGroup(0, base + 2 * kG, kG), std::nullopt);  // nobody reads [2G, 3G)
  EXPECT_EQ(r.WaitGroup(0, base, 4 * kG), std::optional<std::size_t>(2));
  EXPECT_EQ(r.WaitGroup(1, base + 8 * kG, 1), std::optional<std::size_t>(2));
  EXPECT_EQ(r.WaitGroup(2, base, kG), std::nullopt);  // a chunk without reads (discard)
}

}  // namespace
}  // namespace vmstash
