// The control endpoint over a real Unix socket in a private temporary directory: requests
// answered, bad input answered with errors while the server keeps serving, peers of
// another uid refused (injected predicate), timeouts, stale sockets removed, and an
// unsafe directory refused.
#include "control/endpoint.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace vmstash::control {
namespace {

std::string TempDir() {
  // /tmp, not TEST_TMPDIR: a Unix socket path must fit in 108 bytes.
  std::string dir = "/tmp/vmstash-endpoint-XXXXXX";
  char* made = ::mkdtemp(dir.data());
  EXPECT_NE(made, nullptr);
  return absl::StrCat(dir, "/run");  // the server creates it 0700
}

absl::StatusOr<std::string> Echo(const Request& r) {
  if (r.op == Op::kPause) return absl::NotFoundError(absl::StrCat("no tag '", r.tag, "'"));
  return absl::StrCat(R"({"op":")", OpName(r.op), R"(","device":)", r.device, "}");
}

// Sends raw bytes and returns the raw reply line.
std::string Raw(const std::string& path, const std::string& bytes) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  std::size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may stop reading an oversized request
    off += static_cast<std::size_t>(n);
  }
  std::string reply;
  char c;
  while (::recv(fd, &c, 1, 0) == 1 && c != '\n') reply.push_back(c);
  ::close(fd);
  return reply;
}

TEST(EndpointTest, ServesRequestsAndSurvivesBadOnes) {
  ServerOptions options;
  options.dir = TempDir();
  options.timeout_ms = 300;
  absl::StatusOr<std::unique_ptr<ControlServer>> server = ControlServer::Start(options, Echo);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string path = (*server)->socket_path();
  struct stat st;
  ASSERT_EQ(::stat(options.dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  Request hello;
  absl::StatusOr<std::string> r = Call(path, hello);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, R"({"op":"hello","device":-1})");
  Request pause;
  pause.op = Op::kPause;
  pause.tag = "kv";
  EXPECT_EQ(Call(path, pause).status().code(), absl::StatusCode::kNotFound);  // the handler's error
  // Malformed, unknown, other version, oversized, and silent clients: error replies, and
  // the server still answers afterwards.
  EXPECT_NE(Raw(path, "{nonsense\n").find("INVALID_ARGUMENT"), std::string::npos);
  EXPECT_NE(Raw(path, "{\"v\":1,\"op\":\"format_disk\"}\n").find("unknown op"), std::string::npos);
  EXPECT_NE(Raw(path, "{\"v\":9,\"op\":\"hello\"}\n").find("FAILED_PRECONDITION"), std::string::npos);
  EXPECT_NE(Raw(path, std::string(kMaxMessageBytes + 10, 'x') + "\n").find("longer than"), std::string::npos);
  EXPECT_NE(Raw(path, "{\"v\":1,").find("DEADLINE_EXCEEDED"), std::string::npos);  // never finishes its line
  r = Call(path, hello);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE((*server)->served(), 7u);
  // Listed while it lives; gone (socket removed) once stopped.
  std::vector<Endpoint> listed = ListEndpoints(options.dir);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].pid, ::getpid());
  EXPECT_EQ(*EndpointOf(::getpid(), options.dir), path);
  server->reset();
  EXPECT_EQ(::access(path.c_str(), F_OK), -1);
  EXPECT_EQ(Call(path, hello).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(EndpointOf(::getpid(), options.dir).status().code(), absl::StatusCode::kNotFound);
}

TEST(EndpointTest, PeersOfAnotherUidAreRefused) {
  ServerOptions options;
  options.dir = TempDir();
  options.peer_allowed = [](uid_t uid) { return uid == ::getuid() + 1; };  // as if we were someone else
  absl::StatusOr<std::unique_ptr<ControlServer>> server = ControlServer::Start(options, Echo);
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::string> r = Call((*server)->socket_path(), Request{});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_EQ((*server)->refused(), 1u);
}

TEST(EndpointTest, StaleSocketsAreRemovedAndUnsafeDirectoriesRefused) {
  ServerOptions options;
  options.dir = TempDir();
  ASSERT_EQ(::mkdir(options.dir.c_str(), 0700), 0);
  const std::string stale = options.dir + "/999999999.sock";  // no such pid
  std::ofstream(stale) << "";
  EXPECT_TRUE(ListEndpoints(options.dir).empty());
  EXPECT_EQ(::access(stale.c_str(), F_OK), -1);
  EXPECT_EQ(EndpointOf(999999999, options.dir).status().code(), absl::StatusCode::kNotFound);
  ASSERT_EQ(::chmod(options.dir.c_str(), 0755), 0);
  absl::StatusOr<std::unique_ptr<ControlServer>> server = ControlServer::Start(options, Echo);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kPermissionDenied) << server.status();
  EXPECT_NE(server.status().message().find("0700"), absl::string_view::npos);
}

}  // namespace
}  // namespace vmstash::control
