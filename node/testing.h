// Test support for node/ (tests only): private runtime directories removed at exit,
// a node daemon running in a child process, a switch's participant in a child process,
// and a process's count of open descriptors.
#ifndef VMSTASH_NODE_TESTING_H_
#define VMSTASH_NODE_TESTING_H_

#include <dirent.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "control/runtime_dir.h"
#include "node/daemon.h"
#include "node/host_pool.h"
#include "node/wire.h"

namespace vmstash::node {

// Private directories made by the test (0700, as mkdtemp makes them), removed at the
// test process's exit (not a forked child's).
struct MadeDirs {
  pid_t owner = ::getpid();
  std::vector<std::string> dirs;
  ~MadeDirs() {
    if (::getpid() != owner) return;
    std::error_code ignored;
    for (const std::string& d : dirs) std::filesystem::remove_all(d, ignored);
  }
};
inline MadeDirs& Made() {
  static MadeDirs made;
  return made;
}
inline std::string PrivateDir() {
  char tmpl[] = "/tmp/vmstash-node-test-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (dir == nullptr) return "";
  Made().dirs.push_back(dir);
  return dir;
}

// How many descriptors process `pid` has open (-1: it cannot be told).
inline int OpenFds(pid_t pid) {
  int n = 0;
  DIR* d = ::opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (d == nullptr) return -1;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

// A socket listening where the daemon of `dir` would (a fake daemon's: the test answers,
// or does not), with `backlog`; -1 on failure.
inline int ListenAsDaemon(const std::string& dir, int backlog) {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un addr = control::UnixAddress(SocketPath(dir));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, backlog) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A daemon serving `dir` in a child process, until Stop() (or a kill).
class DaemonProcess {
 public:
  explicit DaemonProcess(const std::string& dir, std::size_t capacity = 16 * HostPoolLedger::kUnitBytes) {
    int ready[2], stop[2];
    if (::pipe(ready) != 0 || ::pipe(stop) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(ready[0]);
      ::close(stop[1]);
      DaemonOptions options;
      options.dir = dir;
      options.capacity_bytes = capacity;
      absl::StatusOr<std::unique_ptr<NodeDaemon>> d = NodeDaemon::Start(options);
      const char ok = d.ok() ? 1 : 0;
      (void)!::write(ready[1], &ok, 1);
      char b;
      (void)!::read(stop[0], &b, 1);  // until the test says stop (or dies)
      if (d.ok()) (*d)->Stop();
      ::_exit(0);
    }
    ::close(ready[1]);
    ::close(stop[0]);
    stop_ = stop[1];
    char ok = 0;
    started_ = ::read(ready[0], &ok, 1) == 1 && ok == 1;
    ::close(ready[0]);
  }
  ~DaemonProcess() { Stop(); }
  bool started() const { return started_; }
  pid_t pid() const { return pid_; }
  void Stop() {
    if (pid_ <= 0) return;
    ::close(stop_);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    ::close(stop_);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int stop_ = -1;
  bool started_ = false;
};

// A child process that waits for a switch's id (32 characters) on a pipe, runs `work(id)`
// and writes back what it returns; killed, if still running, when this object goes. With
// `linger`, it stays alive after writing (a participant that exits would abort its
// switch) until this object goes.
class SwitchChild {
 public:
  explicit SwitchChild(const std::function<std::string(const std::string& txn)>& work, bool linger = false)
      : linger_(linger) {
    int go[2], out[2];
    if (::pipe(go) != 0 || ::pipe(out) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(go[1]);
      ::close(out[0]);
      char id[33] = {};
      if (::read(go[0], id, 32) != 32) ::_exit(3);
      const std::string text = work(id);
      (void)!::write(out[1], text.data(), text.size());
      ::close(out[1]);
      if (linger) {
        while (::read(go[0], id, 1) > 0) {
        }
      }
      ::_exit(0);
    }
    ::close(go[0]);
    ::close(out[1]);
    go_ = go[1];
    out_ = out[0];
  }
  ~SwitchChild() {
    Kill();
    if (go_ >= 0) ::close(go_);
    if (out_ >= 0) ::close(out_);
  }
  SwitchChild(const SwitchChild&) = delete;
  SwitchChild& operator=(const SwitchChild&) = delete;
  pid_t pid() const { return pid_; }
  void Go(const std::string& txn) { (void)!::write(go_, txn.data(), txn.size()); }
  // What `work` returned (waits for the child's end, unless it lingers).
  std::string Result() {
    std::string text;
    char buf[65536];
    ssize_t n;
    while ((n = ::read(out_, buf, sizeof(buf))) > 0) text.append(buf, static_cast<std::size_t>(n));
    if (!linger_) {
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
    return text;
  }
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int go_ = -1, out_ = -1;
  bool linger_ = false;
};

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_TESTING_H_
