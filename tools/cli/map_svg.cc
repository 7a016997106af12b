// MapSvg: see map_svg.h.
#include "tools/cli/map_svg.h"


#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/bytes.h"
#include "tools/cli/per_device.h"

namespace vmstash::cli {
namespace {

constexpr int kWidth = 1000, kLeft = 260, kBar = 26, kGap = 22;
const char* const kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"};

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> MapSvg(const JsonValue& snapshot, const std::string& title) {
  absl::StatusOr<std::vector<const JsonValue*>> devices = PerDevice(snapshot, "map");
  if (!devices.ok()) return devices.status();
  std::map<std::string, std::string> colours;
  auto colour = [&](const std::string& tag) {
    auto it = colours.find(tag);
    if (it != colours.end()) return it->second;
    std::string c = kPalette[colours.size() % (sizeof(kPalette) / sizeof(kPalette[0]))];
    colours.emplace(tag, c);
    return c;
  };
  std::string body;
  int y = 40;
  for (const JsonValue* d : *devices) {
    body += absl::StrFormat("<text x=\"10\" y=\"%d\" font-weight=\"bold\">GPU %d (%s)</text>\n", y,
                            (*d)["device"].Int(), Escape((*d)["driver"].String()));
    y += kGap;
    std::map<std::string, std::string> states;
    for (const JsonValue& t : (*d)["tags"].items()) states[t["name"].String()] = t["state"].String();
    for (const JsonValue& seg : (*d)["segments"].items()) {
      const std::string tag = seg["tag"].String();
      // The extent worth drawing: chunks (mapped or holes) and blocks.
      std::int64_t lo = INT64_MAX, hi = 0;
      for (const JsonValue& c : seg["chunks"].items()) {
        lo = std::min(lo, c["address"].Int());
        hi = std::max(hi, c["address"].Int() + c["size"].Int());
      }
      for (const JsonValue& b : seg["blocks"].items()) {
        lo = std::min(lo, b["address"].Int());
        hi = std::max(hi, b["address"].Int() + b["size"].Int());
      }
      if (hi <= lo) continue;  // an empty reservation
      const double scale = static_cast<double>(kWidth) / static_cast<double>(hi - lo);
      auto x = [&](std::int64_t a) { return kLeft + (a - lo) * scale; };
      auto w = [&](std::int64_t n) { return std::max(0.5, n * scale); };
      body += absl::StrFormat(
          "<text x=\"10\" y=\"%d\">%s / %s</text><text x=\"10\" y=\"%d\" font-size=\"10\">%#x, mapped %s</text>\n",
          y + 11, Escape(tag), Escape(seg["heap"].String()), y + 23, lo, HumanBytes(seg["mapped_bytes"].Int()));
      body += absl::StrFormat("<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"#f4f4f4\" stroke=\"#999\"/>\n",
                              kLeft, y, kWidth, kBar);
      for (const JsonValue& c : seg["chunks"].items()) {
        const bool mapped = c["mapped"].Bool(true);
        body += absl::StrFormat(
            "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" fill-opacity=\"%s\" stroke=\"#555\" "
            "stroke-width=\"0.5\"><title>chunk %#x %s %s</title></rect>\n",
            x(c["address"].Int()), y, w(c["size"].Int()), kBar, mapped ? colour(tag) : "#cccccc",
            mapped ? "0.25" : "1", c["address"].Int(), HumanBytes(c["size"].Int()), mapped ? "mapped" : "hole");
      }
      for (const JsonValue& b : seg["blocks"].items()) {
        const bool live = b["live"].Bool();
        const bool paused = live && states[tag] == "paused";
        body += absl::StrFormat(
            "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" fill-opacity=\"%s\" stroke=\"%s\" "
            "stroke-width=\"%s\"%s><title>block %#x %s %s</title></rect>\n",
            x(b["address"].Int()), y + 4, w(b["size"].Int()), kBar - 8, paused ? "none" : colour(tag),
            live ? "0.9" : "0.2", paused ? colour(tag) : "#333", paused ? "1.5" : "0.3",
            paused ? " stroke-dasharray=\"4 2\"" : "", b["address"].Int(), HumanBytes(b["size"].Int()),
            paused ? "live, paused" : live ? "live" : "free");
      }
      y += kBar + kGap;
    }
  }
  std::string legend;
  int lx = kLeft;
  for (const auto& [tag, c] : colours) {
    legend += absl::StrFormat("<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                              "<text x=\"%d\" y=\"%d\">%s</text>\n",
                              lx, y, c, lx + 16, y + 11, Escape(tag));
    lx += 30 + 8 * static_cast<int>(tag.size());
  }
  legend += absl::StrFormat("<text x=\"10\" y=\"%d\" font-size=\"10\">solid: live block; light: free block; dashed: "
                            "live block of a paused tag; grey: unmapped hole</text>\n",
                            y + 30);
  y += 45;
  return absl::StrCat("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", kLeft + kWidth + 20, "\" height=\"", y,
                      "\" font-family=\"sans-serif\" font-size=\"12\">\n<text x=\"10\" y=\"20\" font-size=\"14\">",
                      Escape(title), "</text>\n", body, legend, "</svg>\n");
}

std::string MapHtml(const std::string& svg, const std::string& title) {
  return absl::StrCat("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>", Escape(title),
                      "</title></head>\n<body>\n", svg, "</body></html>\n");
}

}  // namespace vmstash::cli
