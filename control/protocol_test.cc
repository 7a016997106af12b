// The control protocol's parser and formatter: every request shape, and every way a
// request can be wrong gets a clear error (the fuzzer covers the rest).
#include "control/protocol.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace vmstash::control {
namespace {

TEST(ProtocolTest, ParsesEveryOp) {
  absl::StatusOr<Request> r = ParseRequest(R"({"v":1,"op":"hello"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->op, Op::kHello);
  EXPECT_EQ(r->device, -1);
  r = ParseRequest(R"( { "op" : "pause" , "tag" : "kv_cache", "device": 3, "v": 1 } )");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->op, Op::kPause);
  EXPECT_EQ(r->tag, "kv_cache");
  EXPECT_EQ(r->device, 3);
  for (Op op : {Op::kStats, Op::kTags, Op::kSnapshot}) {
    r = ParseRequest(std::string(R"({"v":1,"op":")") + std::string(OpName(op)) + "\"}");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->op, op);
  }
  r = ParseRequest(R"({"v":1,"op":"resume","tag":"a\"b\\c\u0041"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tag, "a\"b\\cA");
}

TEST(ProtocolTest, SwitchTakesCommaSeparatedTagLists) {
  absl::StatusOr<Request> r = ParseRequest(R"({"v":1,"op":"switch","pause":"weights,kv_cache","resume":"optimizer"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->op, Op::kSwitch);
  EXPECT_EQ(r->pause, (std::vector<std::string>{"weights", "kv_cache"}));
  EXPECT_EQ(r->resume, (std::vector<std::string>{"optimizer"}));
  Request in = *r;
  in.device = 1;
  std::string line = FormatRequest(in);
  line.pop_back();
  absl::StatusOr<Request> out = ParseRequest(line);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->pause, in.pause);
  EXPECT_EQ(out->resume, in.resume);
  EXPECT_EQ(out->device, 1);
  EXPECT_EQ(ParseRequest(R"({"v":1,"op":"switch"})").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRequest(R"({"v":1,"op":"switch","pause":",,"})").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRequest(R"({"v":1,"op":"pause","tag":"a","pause":"b"})").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRequest(R"({"v":1,"op":"switch","pause":["a"]})").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ProtocolTest, FormatThenParseRoundTrips) {
  Request in;
  in.op = Op::kResume;
  in.tag = "we\"ird\\tag";
  in.device = 2;
  std::string line = FormatRequest(in);
  ASSERT_EQ(line.back(), '\n');
  line.pop_back();
  absl::StatusOr<Request> out = ParseRequest(line);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->op, in.op);
  EXPECT_EQ(out->tag, in.tag);
  EXPECT_EQ(out->device, in.device);
}

TEST(ProtocolTest, BadRequestsAreClearErrors) {
  struct Case {
    const char* line;
    absl::StatusCode code;
    const char* says;
  } cases[] = {
      {"", absl::StatusCode::kInvalidArgument, "unexpected end"},
      {"not json", absl::StatusCode::kInvalidArgument, "unexpected character"},
      {"[1]", absl::StatusCode::kInvalidArgument, "expected a JSON object"},
      {R"({"v":1,"op":"hello","device":1.5})", absl::StatusCode::kInvalidArgument, "integer"},
      {R"({"v":1,"op":"pause","tag":"\ud800"})", absl::StatusCode::kInvalidArgument, "surrogate"},
      {R"({"v":1})", absl::StatusCode::kInvalidArgument, "missing \"op\""},
      {R"({"op":"hello"})", absl::StatusCode::kInvalidArgument, "missing \"v\""},
      {R"({"v":2,"op":"hello"})", absl::StatusCode::kFailedPrecondition, "version 2"},
      {R"({"v":1,"op":"explode"})", absl::StatusCode::kInvalidArgument, "unknown op"},
      {R"({"v":1,"op":"hello","x":1})", absl::StatusCode::kInvalidArgument, "unknown key"},
      {R"({"v":1,"op":"hello","op":"stats"})", absl::StatusCode::kInvalidArgument, "duplicate key"},
      {R"({"v":1,"op":"pause"})", absl::StatusCode::kInvalidArgument, "needs a \"tag\""},
      {R"({"v":1,"op":"pause","tag":{"a":1}})", absl::StatusCode::kInvalidArgument, "must be a string"},
      {R"({"v":1,"op":"hello","device":-2})", absl::StatusCode::kInvalidArgument, "\"device\" must be"},
      {R"({"v":1,"op":"hello","device":99999999999})", absl::StatusCode::kInvalidArgument, "integer"},
      {R"({"v":1,"op":"hello"} trailing)", absl::StatusCode::kInvalidArgument, "trailing"},
      {R"({"v":1,"op":"hello")", absl::StatusCode::kInvalidArgument, "expected ',' or '}'"},
      {R"({"v":1,"op":"hel)", absl::StatusCode::kInvalidArgument, "unterminated"},
      {R"({"v":1,"op":"pause","tag":"\u00e9"})", absl::StatusCode::kInvalidArgument, "non-ASCII"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Request> r = ParseRequest(c.line);
    ASSERT_FALSE(r.ok()) << c.line;
    EXPECT_EQ(r.status().code(), c.code) << c.line << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.says), absl::string_view::npos) << c.line << ": " << r.status();
  }
  std::string huge = R"({"v":1,"op":"pause","tag":")" + std::string(kMaxMessageBytes, 'x') + "\"}";
  absl::StatusOr<Request> r = ParseRequest(huge);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("exceeds the limit"), absl::string_view::npos);
}

TEST(ProtocolTest, RepliesCarryResultsAndErrors) {
  absl::StatusOr<std::string> ok = ParseReply(OkReply(R"({"pid":42})"));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, R"({"pid":42})");
  absl::StatusOr<std::string> err = ParseReply(ErrorReply(absl::FailedPreconditionError("tag \"x\" is busy")));
  EXPECT_EQ(err.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(err.status().message(), "tag \"x\" is busy");
  EXPECT_EQ(ParseReply(R"({"v":7,"ok":true,"result":1})").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ParseReply("garbage").status().code(), absl::StatusCode::kInternal);
  // An error reply claiming code OK is still an error (the fuzzer's find: it used to abort).
  absl::StatusOr<std::string> ok_error = ParseReply(R"({"v":1,"ok":false,"error":{"code":"OK","message":"x"}})");
  EXPECT_EQ(ok_error.status().code(), absl::StatusCode::kUnknown);
}

}  // namespace
TEST(ControlProtocol, ANodeSwitchPartCarriesItsIdAndTimeout) {
  absl::StatusOr<Request> r = ParseRequest(
      R"({"v":1,"op":"switch","pause":"a","txn":"0123456789abcdef0123456789abcdef","timeout_ms":500})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->txn, "0123456789abcdef0123456789abcdef");
  EXPECT_EQ(r->timeout_ms, 500);
  absl::StatusOr<Request> again = ParseRequest(FormatRequest(*r).substr(0, FormatRequest(*r).size() - 1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->txn, r->txn);
  EXPECT_EQ(again->timeout_ms, 500);
  for (const char* bad : {
           R"({"v":1,"op":"switch","pause":"a","txn":"ab","timeout_ms":500})",
           R"({"v":1,"op":"switch","pause":"a","txn":"0123456789ABCDEF0123456789abcdef","timeout_ms":500})",
           R"({"v":1,"op":"switch","pause":"a","txn":"0123456789abcdef0123456789abcdef"})",
           R"({"v":1,"op":"switch","pause":"a","timeout_ms":500})",
           R"({"v":1,"op":"switch","pause":"a","txn":"0123456789abcdef0123456789abcdef","timeout_ms":0})",
           R"({"v":1,"op":"pause","tag":"a","txn":"0123456789abcdef0123456789abcdef","timeout_ms":5})",
       }) {
    EXPECT_EQ(ParseRequest(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace vmstash::control
