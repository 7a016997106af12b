// The node protocol: see wire.h.
#include "node/wire.h"

#include <poll.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/json_writer.h"
#include "base/status_code.h"
#include "control/runtime_dir.h"

namespace vmstash::node {
namespace {

const char* OpName(WireOp op) {
  switch (op) {
    case WireOp::kHello: return "hello";
    case WireOp::kLease: return "lease";
    case WireOp::kGive: return "give";
    case WireOp::kStats: return "stats";
    case WireOp::kBegin: return "begin";
    case WireOp::kVote: return "vote";
    case WireOp::kOutcome: return "outcome";
    case WireOp::kOffer: return "offer";
    case WireOp::kTake: return "take";
    case WireOp::kSettled: return "settled";
  }
  return "?";
}

absl::StatusOr<std::uint64_t> Count(const JsonValue& doc, const char* key) {
  const JsonValue& v = doc[key];
  if (v.type() != JsonValue::Type::kNumber || v.Int(-1) < 0 || static_cast<double>(v.Int(-1)) != v.Number()) {
    return absl::InvalidArgumentError(absl::StrCat("node protocol: \"", key, "\" must be a count"));
  }
  return static_cast<std::uint64_t>(v.Int());
}

absl::StatusOr<std::string> Text(const JsonValue& doc, const char* key) {
  if (doc[key].type() != JsonValue::Type::kString) {
    return absl::InvalidArgumentError(absl::StrCat("node protocol: \"", key, "\" must be a string"));
  }
  return doc[key].String();
}


}  // namespace

std::string FormatRequest(const WireRequest& r) {
  JsonWriter w;
  w.BeginObject();
  w.Field("v", kWireVersion);
  w.Field("op", OpName(r.op));
  switch (r.op) {
    case WireOp::kHello: w.Field("pid", r.pid); break;
    case WireOp::kLease:
      w.Field("bytes", r.bytes);
      w.Field("tag", r.tag);
      break;
    case WireOp::kGive: w.Field("offset", r.offset); break;
    case WireOp::kStats: break;
    case WireOp::kBegin:
      w.Field("pids", r.pids);
      w.Field("timeout_ms", r.timeout_ms);
      if (!r.donors.empty()) w.Field("donors", r.donors);
      break;
    case WireOp::kVote:
      w.Field("txn", r.txn);
      w.Field("pid", r.pid);
      w.Field("ok", r.ok);
      w.Field("reason", r.reason);
      break;
    case WireOp::kOutcome:
    case WireOp::kSettled:
      w.Field("txn", r.txn);
      w.Field("pid", r.pid);
      break;
    case WireOp::kOffer:
    case WireOp::kTake:
      w.Field("txn", r.txn);
      w.Field("pid", r.pid);
      w.Field("device", r.device);
      if (r.op == WireOp::kOffer) {
        w.Field("sizes", r.sizes);
        w.Field("uses", r.uses);
        w.Field("last", r.last);
      } else {
        w.Field("gaps", FormatGaps(r.gaps));
      }
      break;
  }
  w.EndObject();
  return w.str();
}

absl::StatusOr<WireRequest> ParseRequest(absl::string_view text) {
  absl::StatusOr<JsonValue> doc = JsonValue::Parse(text);
  if (!doc.ok()) return absl::InvalidArgumentError(absl::StrCat("node protocol: ", doc.status().message()));
  if (!doc->is_object()) return absl::InvalidArgumentError("node protocol: a request is a JSON object");
  if ((*doc)["v"].Number(-1) != kWireVersion) {
    return absl::FailedPreconditionError(absl::StrCat("node protocol: version ", (*doc)["v"].Int(-1),
                                                      ", this daemon speaks version ", kWireVersion));
  }
  WireRequest r;
  const std::string op = (*doc)["op"].String();
  std::vector<std::string> keys = {"v", "op"};
  if (op == "hello") {
    r.op = WireOp::kHello;
    absl::StatusOr<std::uint64_t> pid = Count(*doc, "pid");
    if (!pid.ok()) return pid.status();
    r.pid = static_cast<std::int64_t>(*pid);
    keys.push_back("pid");
  } else if (op == "lease") {
    r.op = WireOp::kLease;
    absl::StatusOr<std::uint64_t> bytes = Count(*doc, "bytes");
    if (!bytes.ok()) return bytes.status();
    r.bytes = *bytes;
    absl::StatusOr<std::string> tag = Text(*doc, "tag");
    if (!tag.ok()) return tag.status();
    r.tag = *tag;
    keys.insert(keys.end(), {"bytes", "tag"});
  } else if (op == "give") {
    r.op = WireOp::kGive;
    absl::StatusOr<std::uint64_t> offset = Count(*doc, "offset");
    if (!offset.ok()) return offset.status();
    r.offset = *offset;
    keys.push_back("offset");
  } else if (op == "stats") {
    r.op = WireOp::kStats;
  } else if (op == "begin") {
    r.op = WireOp::kBegin;
    absl::StatusOr<std::string> pids = Text(*doc, "pids");
    absl::StatusOr<std::uint64_t> timeout = Count(*doc, "timeout_ms");
    if (!pids.ok()) return pids.status();
    if (!timeout.ok()) return timeout.status();
    r.pids = *pids;
    r.timeout_ms = *timeout;
    keys.insert(keys.end(), {"pids", "timeout_ms", "donors"});
    if ((*doc)["donors"].type() != JsonValue::Type::kNull) {
      absl::StatusOr<std::string> donors = Text(*doc, "donors");
      if (!donors.ok()) return donors.status();
      r.donors = *donors;
    }
  } else if (op == "vote" || op == "outcome" || op == "offer" || op == "take" || op == "settled") {
    r.op = op == "vote"      ? WireOp::kVote
           : op == "outcome" ? WireOp::kOutcome
           : op == "offer"   ? WireOp::kOffer
           : op == "take"    ? WireOp::kTake
                             : WireOp::kSettled;
    absl::StatusOr<std::string> txn = Text(*doc, "txn");
    absl::StatusOr<std::uint64_t> pid = Count(*doc, "pid");
    if (!txn.ok()) return txn.status();
    if (!pid.ok()) return pid.status();
    r.txn = *txn;
    r.pid = static_cast<std::int64_t>(*pid);
    keys.insert(keys.end(), {"txn", "pid"});
    if (r.op == WireOp::kVote) {
      if ((*doc)["ok"].type() != JsonValue::Type::kBool) {
        return absl::InvalidArgumentError("node protocol: \"ok\" must be true or false");
      }
      absl::StatusOr<std::string> reason = Text(*doc, "reason");
      if (!reason.ok()) return reason.status();
      r.ok = (*doc)["ok"].Bool();
      r.reason = *reason;
      keys.insert(keys.end(), {"ok", "reason"});
    }
    if (r.op == WireOp::kOffer || r.op == WireOp::kTake) {
      absl::StatusOr<std::string> device = Text(*doc, "device");
      if (!device.ok()) return device.status();
      if (device->empty()) return absl::InvalidArgumentError("node protocol: \"device\" is empty");
      r.device = *device;
      keys.push_back("device");
    }
    if (r.op == WireOp::kOffer) {
      absl::StatusOr<std::string> sizes = Text(*doc, "sizes");
      if (!sizes.ok()) return sizes.status();
      absl::StatusOr<std::vector<std::size_t>> counted = ParseSizes(*sizes);
      if (!counted.ok()) return counted.status();
      absl::StatusOr<std::string> uses = Text(*doc, "uses");
      if (!uses.ok()) return uses.status();
      if (absl::Status s = ParseUses(*uses, counted->size()).status(); !s.ok()) return s;
      if ((*doc)["last"].type() != JsonValue::Type::kBool) {
        return absl::InvalidArgumentError("node protocol: \"last\" must be true or false");
      }
      r.sizes = *sizes;
      r.uses = *uses;
      r.last = (*doc)["last"].Bool();
      keys.insert(keys.end(), {"sizes", "uses", "last"});
    }
    if (r.op == WireOp::kTake) {
      absl::StatusOr<std::string> gaps = Text(*doc, "gaps");
      if (!gaps.ok()) return gaps.status();
      absl::StatusOr<std::vector<FitGap>> parsed = ParseGaps(*gaps);
      if (!parsed.ok()) return parsed.status();
      r.gaps = *std::move(parsed);
      keys.push_back("gaps");
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("node protocol: unknown op \"", op, "\""));
  }
  for (const auto& [key, value] : doc->members()) {
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      return absl::InvalidArgumentError(absl::StrCat("node protocol: unknown key \"", key, "\" in ", op));
    }
  }
  return r;
}

namespace {

// How ParseReply's status for a reply of another version begins (IsOtherVersion).
constexpr absl::string_view kOtherVersionLead = "node daemon: it speaks node protocol ";

// A byte count written as digits only (SimpleAtoi alone would take " +12").
bool Digits(absl::string_view text, std::uint64_t* out) {
  if (text.empty() || !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  return absl::SimpleAtoi(text, out);
}

}  // namespace

absl::StatusOr<std::vector<std::size_t>> ParseSizes(absl::string_view sizes) {
  std::vector<std::size_t> out;
  if (sizes.empty()) return out;
  for (absl::string_view s : absl::StrSplit(sizes, ',')) {
    std::uint64_t n = 0;
    if (!Digits(s, &n) || n == 0) {
      return absl::InvalidArgumentError(absl::StrCat("node protocol: \"", s, "\" in \"sizes\" is not a byte count"));
    }
    out.push_back(static_cast<std::size_t>(n));
  }
  return out;
}

absl::StatusOr<std::vector<FitGap>> ParseGaps(absl::string_view gaps) {
  std::vector<FitGap> out;
  if (gaps.empty()) return out;
  for (absl::string_view g : absl::StrSplit(gaps, ',')) {
    const std::vector<absl::string_view> parts = absl::StrSplit(g, ':');
    std::uint64_t size = 0;
    std::uint64_t overhang = 0;
    if (parts.size() < 2 || parts.size() > 3 || !Digits(parts[0], &size) || size == 0 ||
        !Digits(parts[1], &overhang) || (parts.size() == 3 && parts[2] != "r")) {
      return absl::InvalidArgumentError(
          absl::StrCat("node protocol: \"", g, "\" in \"gaps\" is not BYTES:OVERRUN[:r] (BYTES > 0)"));
    }
    if (out.size() == kMaxTakeGaps) {
      return absl::InvalidArgumentError(absl::StrCat("node protocol: a take names at most ", kMaxTakeGaps, " gaps"));
    }
    out.push_back({static_cast<std::size_t>(size), static_cast<std::size_t>(overhang), parts.size() == 3});
  }
  return out;
}

std::string FormatGaps(const std::vector<FitGap>& gaps) {
  std::vector<std::string> parts;
  for (const FitGap& g : gaps) {
    parts.push_back(absl::StrCat(g.size_bytes, ":", g.max_overhang_bytes, g.strict ? ":r" : ""));
  }
  return absl::StrJoin(parts, ",");
}

absl::StatusOr<std::vector<ChunkUse>> ParseUses(absl::string_view uses, std::size_t count) {
  std::vector<ChunkUse> out;
  if (!uses.empty()) {
    for (absl::string_view u : absl::StrSplit(uses, ',')) {
      if (u == "-" || u == "+") {
        out.push_back({u == "+", ""});
        continue;
      }
      const bool hex = std::all_of(u.begin(), u.end(), [](char c) { return absl::ascii_isxdigit(c); });
      if (u.size() != kEventHandleHex || !hex) {
        return absl::InvalidArgumentError(absl::StrCat("node protocol: \"", u.substr(0, 32), "\" in \"uses\" is not "
                                                       "\"-\", \"+\" or an event handle of ", kEventHandleHex,
                                                       " hex digits"));
      }
      out.push_back({true, absl::HexStringToBytes(u)});
    }
  }
  if (out.size() != count) {
    return absl::InvalidArgumentError(absl::StrCat("node protocol: ", out.size(), " uses for ", count, " chunks"));
  }
  return out;
}

std::string FormatUses(const std::vector<ChunkUse>& uses) {
  std::vector<std::string> parts;
  for (const ChunkUse& u : uses) {
    parts.push_back(!u.wait_event.empty() ? absl::BytesToHexString(u.wait_event) : u.anywhere ? "+" : "-");
  }
  return absl::StrJoin(parts, ",");
}

std::string FormatError(const absl::Status& status) {
  JsonWriter w;
  w.BeginObject();
  w.Field("v", kWireVersion);
  w.Field("ok", false);
  w.Field("code", absl::StatusCodeToString(status.code()));
  w.Field("message", status.message());
  w.EndObject();
  return w.str();
}

absl::StatusOr<JsonValue> ParseReply(absl::string_view text) {
  absl::StatusOr<JsonValue> doc = JsonValue::Parse(text);
  if (!doc.ok() || !doc->is_object()) return absl::InternalError("node protocol: the daemon's reply is not JSON");
  if ((*doc)["v"].Number(-1) != kWireVersion) {
    const std::string theirs = (*doc)["v"].type() == JsonValue::Type::kNumber
                                   ? absl::StrCat("version ", (*doc)["v"].Int())
                                   : "without a version";
    const std::string said = (*doc)["message"].String();
    return absl::FailedPreconditionError(absl::StrCat(
        kOtherVersionLead, theirs, ", this library version ", kWireVersion,
        " (another vmstash release started it", said.empty() ? "" : absl::StrCat("; it said \"", said, "\""),
        "): once no process uses it, `vmstash daemon stop` and `vmstash daemon start` (or a process started "
        "with node:1) put this release's in its place"));
  }
  if ((*doc)["ok"].Bool(false)) return doc;
  return absl::Status(ErrorCodeNamed((*doc)["code"].String()), absl::StrCat("node daemon: ", (*doc)["message"].String()));
}

bool IsOtherVersion(const absl::Status& status) {
  return absl::IsFailedPrecondition(status) && absl::StartsWith(status.message(), kOtherVersionLead);
}

std::string SocketPath(const std::string& dir) { return absl::StrCat(dir, "/", kSocketName); }

absl::StatusOr<int> Connect(const std::string& path) {
  // Non-blocking while connecting: a daemon that stopped accepting (stopped, hung) has a
  // full queue, where a blocking connect would wait for good; here it is EAGAIN at once.
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return control::Errno("node: socket", errno);
  sockaddr_un addr = control::UnixAddress(path);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EAGAIN) {
      return absl::UnavailableError(absl::StrCat("node: the daemon on ", path,
                                                 " accepts no connection (its queue is full: is it stopped or hung?)"));
    }
    return absl::UnavailableError(absl::StrCat("node: no daemon serves ", path, " (", std::strerror(err), ")"));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    return control::Errno("node: fcntl", err);
  }
  return fd;
}

absl::StatusOr<int> ConnectTrusted(const std::string& dir_or_default) {
  const std::string dir = dir_or_default.empty() ? control::DefaultRuntimeDir() : dir_or_default;
  if (absl::Status s = control::CheckPrivateDir(dir); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("node: refusing the runtime directory: ", s.message()));
  }
  const std::string path = SocketPath(dir);
  absl::StatusOr<int> fd = Connect(path);
  if (!fd.ok()) return fd;
  absl::StatusOr<control::Peer> peer = control::PeerOf(*fd);
  if (!peer.ok() || peer->uid != ::getuid()) {
    ::close(*fd);
    return absl::PermissionDeniedError(absl::StrCat("node: the daemon at ", path, " does not run as this user; refused"));
  }
  return fd;
}

absl::StatusOr<JsonValue> AskOnce(const std::string& dir, const WireRequest& request, int timeout_ms) {
  absl::StatusOr<int> fd = ConnectTrusted(dir);
  if (!fd.ok()) return fd.status();
  absl::Status s = Send(*fd, FormatRequest(request));
  absl::StatusOr<Received> got = s.ok() ? Receive(*fd, timeout_ms) : absl::StatusOr<Received>(s);
  ::close(*fd);
  if (!got.ok()) return got.status();
  CloseAll(*got);
  return ParseReply(got->message);
}

bool DaemonGone(const std::string& dir_or_default) {
  const std::string dir = dir_or_default.empty() ? control::DefaultRuntimeDir() : dir_or_default;
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  sockaddr_un addr = control::UnixAddress(SocketPath(dir));
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::close(fd);
  return rc != 0 && (err == ECONNREFUSED || err == ENOENT);
}

absl::Status Send(int socket, absl::string_view message, int fd) {
  return SendFds(socket, message, fd >= 0 ? std::vector<int>{fd} : std::vector<int>{});
}

absl::Status SendFds(int socket, absl::string_view message, const std::vector<int>& fds) {
  if (message.size() > kMaxMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("node protocol: a message of ", message.size(), " bytes"));
  }
  if (fds.size() > kMaxFdsPerPacket) {
    return absl::InvalidArgumentError(absl::StrCat("node protocol: ", fds.size(), " descriptors on one packet"));
  }
  iovec iov{const_cast<char*>(message.data()), message.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerPacket)];
  if (!fds.empty()) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    if (::sendmsg(socket, &msg, MSG_NOSIGNAL) >= 0) return absl::OkStatus();
    if (errno == EINTR) continue;
    if (errno == EPIPE || errno == ECONNRESET) return absl::UnavailableError("node protocol: the peer closed the connection");
    return control::Errno("node protocol: send", errno);
  }
}

void CloseAll(Received& r) {
  for (int fd : r.fds) ::close(fd);
  r.fds.clear();
  r.fd = -1;
}

absl::StatusOr<Received> Receive(int socket, int timeout_ms, std::size_t max_fds) {
  pollfd p{socket, POLLIN | POLLRDHUP, 0};
  for (;;) {
    const int n = ::poll(&p, 1, timeout_ms);
    if (n > 0) break;
    if (n == 0) return absl::DeadlineExceededError(absl::StrCat("node protocol: no reply within ", timeout_ms, " ms"));
    if (errno != EINTR) return control::Errno("node protocol: poll", errno);
  }
  std::string buf(kMaxMessageBytes + 1, '\0');
  iovec iov{buf.data(), buf.size()};
  constexpr std::size_t kMaxFds = kMaxFdsPerPacket + 16;  // room to see (and close) what a peer should not have sent
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got;
  do {
    got = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (got < 0 && errno == EINTR);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    return absl::DeadlineExceededError("node protocol: nothing to read");
  }
  if (got < 0 && errno == ECONNRESET) return absl::UnavailableError("node protocol: the peer closed the connection");
  if (got < 0) return control::Errno("node protocol: receive", errno);
  // Every descriptor that came: the first max_fds are the message's, the others are closed.
  Received r;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (r.fds.size() < max_fds) r.fds.push_back(fd); else ::close(fd);
    }
  }
  const bool hung_up = (p.revents & (POLLHUP | POLLRDHUP)) != 0;
  if ((got == 0 && hung_up) || static_cast<std::size_t>(got) > kMaxMessageBytes ||
      (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    CloseAll(r);
    if (got == 0) return absl::UnavailableError("node protocol: the peer closed the connection");
    if ((msg.msg_flags & MSG_CTRUNC) != 0) {
      return absl::InvalidArgumentError(
          "node protocol: descriptors of a message were dropped (more than the protocol allows, or this "
          "process is out of descriptors)");
    }
    return absl::InvalidArgumentError("node protocol: a message longer than the protocol allows");
  }
  r.message.assign(buf.data(), static_cast<std::size_t>(got));  // an empty packet: an empty message
  r.fd = r.fds.empty() ? -1 : r.fds[0];
  return r;
}

}  // namespace vmstash::node
