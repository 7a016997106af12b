// The records of node switch decisions: see decision_record.h.
#include "node/decision_record.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>
#include <ctime>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "control/runtime_dir.h"

namespace vmstash::node {
namespace {

constexpr std::size_t kMaxRecordBytes = 16 << 10;

std::string RecordDir(const std::string& dir) {
  return absl::StrCat(dir.empty() ? control::DefaultRuntimeDir() : dir, "/vmstashd.switch");
}

absl::Status EnsureRecordDir(const std::string& dir) {
  const std::string d = RecordDir(dir);
  if (::mkdir(d.c_str(), 0700) != 0 && errno != EEXIST) return control::Errno(absl::StrCat("node switch: mkdir ", d), errno);
  return control::CheckPrivateDir(d);
}

std::string Format(const std::vector<pid_t>& pids, const SwitchDecision& d) {
  return absl::StrCat(d.commit ? "commit" : "abort", "\n", absl::StrJoin(pids, ","), "\n", d.reason);
}

struct Parsed {
  SwitchDecision decision;
  std::vector<pid_t> pids;
};

absl::StatusOr<Parsed> Parse(const std::string& text, const std::string& path) {
  std::vector<std::string> lines = absl::StrSplit(text, absl::MaxSplits('\n', 2));
  Parsed p;
  if (lines.size() < 2 || (lines[0] != "commit" && lines[0] != "abort")) {
    return absl::DataLossError(absl::StrCat("node switch: the record ", path, " is not a decision"));
  }
  p.decision.commit = lines[0] == "commit";
  if (lines.size() == 3) p.decision.reason = lines[2];
  for (absl::string_view s : absl::StrSplit(lines[1], ',', absl::SkipEmpty())) {
    int pid = 0;
    if (absl::SimpleAtoi(s, &pid) && pid > 0) p.pids.push_back(pid);
  }
  return p;
}

absl::StatusOr<std::optional<Parsed>> ReadRecord(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return std::optional<Parsed>();
    return control::Errno(absl::StrCat("node switch: open ", path), errno);
  }
  std::string text(kMaxRecordBytes, '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  absl::StatusOr<Parsed> p = Parse(text, path);
  if (!p.ok()) return p.status();
  return std::optional<Parsed>(std::move(*p));
}

}  // namespace

absl::StatusOr<std::string> NewSwitchId() {
  unsigned char bytes[16];
  std::size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return control::Errno("node switch: getrandom", errno);
    got += static_cast<std::size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id;
  for (unsigned char b : bytes) {
    id.push_back(kHex[b >> 4]);
    id.push_back(kHex[b & 15]);
  }
  return id;
}

bool IsSwitchId(const std::string& id) {
  if (id.size() != 32) return false;
  for (char c : id) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

absl::StatusOr<SwitchDecision> RecordDecision(const std::string& dir, const std::string& id,
                                              const std::vector<pid_t>& pids, const SwitchDecision& decision) {
  if (!IsSwitchId(id)) return absl::InvalidArgumentError(absl::StrCat("node switch: \"", id, "\" is not a switch id"));
  if (absl::Status s = EnsureRecordDir(dir); !s.ok()) return s;
  const std::string path = absl::StrCat(RecordDir(dir), "/", id);
  absl::StatusOr<std::string> salt = NewSwitchId();
  if (!salt.ok()) return salt.status();
  const std::string temp = absl::StrCat(RecordDir(dir), "/.", id, ".", *salt);
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return control::Errno(absl::StrCat("node switch: create ", temp), errno);
  std::string text = Format(pids, decision);
  if (text.size() > kMaxRecordBytes) text.resize(kMaxRecordBytes);
  std::size_t put = 0;
  int err = 0;
  while (put < text.size()) {
    const ssize_t n = ::write(fd, text.data() + put, text.size() - put);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      err = errno;
      break;
    }
    put += static_cast<std::size_t>(n);
  }
  ::close(fd);
  const int linked = err == 0 ? ::link(temp.c_str(), path.c_str()) : -1;
  if (err == 0 && linked != 0) err = errno;
  ::unlink(temp.c_str());
  if (linked == 0) return decision;
  if (err != EEXIST) return control::Errno(absl::StrCat("node switch: record ", path), err);
  absl::StatusOr<std::optional<Parsed>> earlier = ReadRecord(path);  // someone recorded first: theirs stands
  if (!earlier.ok()) return earlier.status();
  if (!earlier->has_value()) return absl::DataLossError(absl::StrCat("node switch: the record ", path, " vanished"));
  return (*earlier)->decision;
}

absl::StatusOr<std::optional<SwitchDecision>> ReadDecision(const std::string& dir, const std::string& id) {
  if (!IsSwitchId(id)) return absl::InvalidArgumentError(absl::StrCat("node switch: \"", id, "\" is not a switch id"));
  absl::StatusOr<std::optional<Parsed>> p = ReadRecord(absl::StrCat(RecordDir(dir), "/", id));
  if (!p.ok()) return p.status();
  if (!p->has_value()) return std::optional<SwitchDecision>();
  return std::optional<SwitchDecision>((*p)->decision);
}

void RemoveDecision(const std::string& dir, const std::string& id) {
  if (!IsSwitchId(id)) return;
  ::unlink(absl::StrCat(RecordDir(dir), "/", id).c_str());
  ::unlink(absl::StrCat(RecordDir(dir), "/", id, ".took").c_str());
}

absl::Status RecordTaker(const std::string& dir, const std::string& id, pid_t giver, pid_t taker) {
  if (!IsSwitchId(id)) return absl::InvalidArgumentError(absl::StrCat("node switch: \"", id, "\" is not a switch id"));
  if (absl::Status s = EnsureRecordDir(dir); !s.ok()) return s;
  const std::string path = absl::StrCat(RecordDir(dir), "/", id, ".took");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0) return control::Errno(absl::StrCat("node switch: open ", path), errno);
  const std::string line = absl::StrCat(giver, " ", taker, "\n");  // one write: appended whole
  ssize_t n;
  do {
    n = ::write(fd, line.data(), line.size());
  } while (n < 0 && errno == EINTR);
  const int err = n < 0 ? errno : 0;
  ::close(fd);
  if (n != static_cast<ssize_t>(line.size())) {
    return control::Errno(absl::StrCat("node switch: write ", path), err != 0 ? err : EIO);
  }
  return absl::OkStatus();
}

namespace {

// The (giver, taker) pairs noted for `id` (none when nothing was noted).
absl::StatusOr<std::vector<std::pair<pid_t, pid_t>>> ReadTakers(const std::string& dir, const std::string& id) {
  std::vector<std::pair<pid_t, pid_t>> pairs;
  const std::string path = absl::StrCat(RecordDir(dir), "/", id, ".took");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return pairs;
    return control::Errno(absl::StrCat("node switch: open ", path), errno);
  }
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return control::Errno(absl::StrCat("node switch: read ", path), err);
    }
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const std::vector<absl::string_view> pair = absl::StrSplit(line, ' ');
    int g = 0, t = 0;
    if (pair.size() == 2 && absl::SimpleAtoi(pair[0], &g) && absl::SimpleAtoi(pair[1], &t)) pairs.emplace_back(g, t);
  }
  return pairs;
}

bool Alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

}  // namespace

absl::StatusOr<std::vector<pid_t>> RecordedTakers(const std::string& dir, const std::string& id, pid_t giver) {
  if (!IsSwitchId(id)) return absl::InvalidArgumentError(absl::StrCat("node switch: \"", id, "\" is not a switch id"));
  absl::StatusOr<std::vector<std::pair<pid_t, pid_t>>> pairs = ReadTakers(dir, id);
  if (!pairs.ok()) return pairs.status();
  std::vector<pid_t> takers;
  for (const auto& [g, t] : *pairs) {
    if (g == giver && std::find(takers.begin(), takers.end(), t) == takers.end()) takers.push_back(t);
  }
  return takers;
}

int SweepDecisions(const std::string& dir) {
  DIR* d = ::opendir(RecordDir(dir).c_str());
  if (d == nullptr) return 0;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  int removed = 0;
  for (const std::string& name : names) {
    // A writer's temporary ".<id>.<salt>" left by a writer that died: gone after a minute.
    if (name.size() > 34 && name[0] == '.' && IsSwitchId(name.substr(1, 32))) {
      const std::string path = absl::StrCat(RecordDir(dir), "/", name);
      struct stat st;
      if (::stat(path.c_str(), &st) == 0 && ::time(nullptr) - st.st_mtime > 60) ::unlink(path.c_str());
      continue;
    }
    // Takers' notes of a switch whose record is gone (or never came): an hour after.
    if (name.size() == 37 && name.compare(32, 5, ".took") == 0 && IsSwitchId(name.substr(0, 32))) {
      const std::string path = absl::StrCat(RecordDir(dir), "/", name);
      struct stat st;
      if (::access(absl::StrCat(RecordDir(dir), "/", name.substr(0, 32)).c_str(), F_OK) != 0 &&
          ::stat(path.c_str(), &st) == 0 && ::time(nullptr) - st.st_mtime > 3600) {
        ::unlink(path.c_str());
      }
      continue;
    }
    if (!IsSwitchId(name)) continue;
    absl::StatusOr<std::optional<Parsed>> p = ReadRecord(absl::StrCat(RecordDir(dir), "/", name));
    if (!p.ok() || !p->has_value()) continue;
    // The takers' notes count too: a giver may still read them (a record a participant
    // wrote names only itself).
    bool alive = false;
    for (pid_t pid : (*p)->pids) alive = alive || Alive(pid);
    absl::StatusOr<std::vector<std::pair<pid_t, pid_t>>> noted = ReadTakers(dir, name);
    if (!noted.ok()) continue;
    for (const auto& [g, t] : *noted) alive = alive || Alive(g) || Alive(t);
    if (!alive) {
      RemoveDecision(dir, name);
      ++removed;
    }
  }
  return removed;
}

}  // namespace vmstash::node
