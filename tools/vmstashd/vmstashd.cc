// vmstashd: the node's memory daemon (node/daemon.h, Note [Node Daemon Lifecycle];
// docs/node.md), in the foreground:
//
//   vmstashd --capacity SIZE [--dir DIR] [--detach]
//
// SIZE: the node pool's bytes ("64G", "512M", ...; base/conf.h's sizes), DIR: the runtime
// directory (default: control/runtime_dir.h's). Serves until SIGINT or SIGTERM, then
// stops: every client's leases go back, the socket is removed. Exit status 0 after a
// stop, 1 when it could not start (the reason on stderr), 2 for bad arguments.
// --detach: first leaves the caller (forks: the caller's child exits 0 at once) and its
// session (setsid), as node/launch.h starts it; its errors then go only to stderr.
#include <dirent.h>
#include <limits.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/conf.h"
#include "node/daemon.h"

namespace {

int Usage(const char* why) {
  std::fprintf(stderr, "vmstashd: %s\nusage: vmstashd --capacity SIZE [--dir DIR] [--detach]\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  vmstash::node::DaemonOptions options;
  bool detach = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--capacity" || arg == "--dir") && i + 1 >= argc) return Usage("a value is missing");
    if (arg == "--capacity") {
      absl::StatusOr<std::uint64_t> size = vmstash::ParseSize(argv[++i]);
      if (!size.ok()) return Usage(std::string(size.status().message()).c_str());
      options.capacity_bytes = static_cast<std::size_t>(*size);
    } else if (arg == "--dir") {
      options.dir = argv[++i];
    } else if (arg == "--detach") {
      detach = true;
    } else {
      return Usage(("unknown argument " + arg).c_str());
    }
  }
  if (options.capacity_bytes == 0) return Usage("--capacity is required");
  // A node switch's chunks wait here as descriptors (node/wire.h, kMaxHeldChunks): as many
  // as the hard limit allows.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &files);
  }
  if (!options.dir.empty() && options.dir[0] != '/') {  // --detach leaves the working directory
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof(cwd)) != nullptr) options.dir = std::string(cwd) + "/" + options.dir;
  }
  if (detach) {  // before any thread: the daemon is the grandchild, in its own session
    const pid_t child = fork();
    if (child < 0) {
      std::perror("vmstashd: fork");
      return 1;
    }
    if (child > 0) return 0;
    setsid();
    // Nothing of the caller's kept: its working directory, and descriptors it left open
    // without O_CLOEXEC (a lock, a pipe) beyond stdin, stdout and stderr.
    if (chdir("/") != 0) std::perror("vmstashd: chdir /");
    if (DIR* fds = opendir("/proc/self/fd")) {
      std::vector<int> open;
      while (const dirent* e = readdir(fds)) {
        const int fd = std::atoi(e->d_name);
        if (fd > 2 && fd != dirfd(fds)) open.push_back(fd);
      }
      closedir(fds);
      for (int fd : open) close(fd);
    }
  }
  // The signals are taken synchronously (sigwait): block them before the serving thread starts.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  absl::StatusOr<std::unique_ptr<vmstash::node::NodeDaemon>> daemon = vmstash::node::NodeDaemon::Start(options);
  if (!daemon.ok()) {
    std::fprintf(stderr, "vmstashd: %s\n", std::string(daemon.status().message()).c_str());
    return 1;
  }
  std::fprintf(stderr, "vmstashd: serving a pool of %zu bytes on %s (pid %ld)\n", (*daemon)->stats().capacity_bytes,
               (*daemon)->socket_path().c_str(), static_cast<long>(getpid()));
  int sig = 0;
  sigwait(&stop, &sig);
  (*daemon)->Stop();
  std::fprintf(stderr, "vmstashd: stopped (%s)\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  return 0;
}
