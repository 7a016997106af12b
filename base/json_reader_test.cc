#include "base/json_reader.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(JsonReaderTest, ReadsDocuments) {
  absl::StatusOr<JsonValue> v =
      JsonValue::Parse(R"( {"a": [1, -2.5e1, true, false, null, "x\ty"], "b": {"c": 9007199254740993}} )");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->members().size(), 2u);
  const JsonValue& a = (*v)["a"];
  ASSERT_TRUE(a.is_array());
  EXPECT_EQ(a.items()[0].Int(), 1);
  EXPECT_EQ(a.items()[1].Number(), -25.0);
  EXPECT_TRUE(a.items()[2].Bool());
  EXPECT_FALSE(a.items()[3].Bool(true));
  EXPECT_EQ(a.items()[4].type(), JsonValue::Type::kNull);
  EXPECT_EQ(a.items()[5].String(), "x\ty");
  EXPECT_EQ((*v)["b"]["c"].Int(), 9007199254740993);  // exact beyond a double's 53 bits
  EXPECT_EQ((*v)["missing"]["deeper"].type(), JsonValue::Type::kNull);
}

TEST(JsonReaderTest, HugeNonIntegralNumbersClampTheirIntegerView) {
  absl::StatusOr<JsonValue> v = JsonValue::Parse("[1e20, -1e20, 2.5, 99999999999999999999]");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->items()[0].Int(), INT64_MAX);
  EXPECT_EQ(v->items()[1].Int(), INT64_MIN);
  EXPECT_EQ(v->items()[2].Int(), 2);
  EXPECT_EQ(v->items()[3].Int(), INT64_MAX);
}

TEST(JsonReaderTest, UnicodeEscapesBecomeUtf8) {
  absl::StatusOr<JsonValue> v = JsonValue::Parse(R"(["\u0041\u00e9\u20ac\ud83d\ude00"])");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->items()[0].String(), "A\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
}

TEST(JsonReaderTest, RejectsWhatRfc8259Rejects) {
  for (const char* bad : {
           "", "{", "[1,]", "{\"a\":1,}", "01", "1.", ".5", "-", "1e", "+1", "1-2", "0x10", "NaN", "1e999",
           "\"\\u12\"", "\"\\u12G4\"", "\"\\ud800\"", "\"\\udc00\"", "\"\\ud800\\u0041\"", "\"a\nb\"", "\"\\x\"",
           "{\"a\":1,\"a\":2}", "[1] 2", "tru", "{1:2}", "\"unterminated",
       }) {
    absl::StatusOr<JsonValue> v = JsonValue::Parse(bad);
    EXPECT_FALSE(v.ok()) << "accepted: " << bad;
    if (!v.ok()) EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(JsonReaderTest, NestingIsBounded) {
  std::string deep(JsonValue::kMaxDepth + 2, '[');
  deep += std::string(JsonValue::kMaxDepth + 2, ']');
  absl::StatusOr<JsonValue> v = JsonValue::Parse(deep);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("nested too deeply"), std::string::npos);
  std::string ok(JsonValue::kMaxDepth, '[');
  ok += std::string(JsonValue::kMaxDepth, ']');
  EXPECT_TRUE(JsonValue::Parse(ok).ok());
}

}  // namespace
}  // namespace vmstash
