#include "base/json_writer.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(JsonWriterTest, NestedContainersAndEscapes) {
  JsonWriter w;
  w.BeginObject();
  w.Field("a", 1);
  w.Key("list");
  w.BeginArray();
  w.Uint(18446744073709551615u);
  w.String("q\"\\\n\x01");
  w.Bool(false);
  w.Null();
  w.BeginObject();
  w.EndObject();
  w.EndArray();
  w.Field("d", 0.5);
  w.EndObject();
  EXPECT_EQ(w.str(), R"({"a":1,"list":[18446744073709551615,"q\"\\\n\u0001",false,null,{}],"d":0.5})");
}

}  // namespace
}  // namespace vmstash
