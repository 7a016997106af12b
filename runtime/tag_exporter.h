// TagExporter: the exporting process's side of mapped tags (Note [Mapped Tags] in
// tag_share.h): it serves `<runtime dir>/<pid>.tags.sock`, grants the shared tags'
// chunks to importers, and, as the Runtime's TransitionObserver, revokes them before a
// call that may release them and grants them again after it.
//
// Threads: one accept thread takes new importers (their map request, the first grant);
// revokes and grants run in the thread of the transition. One lock (ops_mu_) orders every
// exchange with importers, so an importer sees the events of one tag in the order the
// transitions happened; the table of shared tags is read under it too.
//
// Thread-safety: every method may be called from any thread.
#ifndef VMSTASH_RUNTIME_TAG_EXPORTER_H_
#define VMSTASH_RUNTIME_TAG_EXPORTER_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/tag.h"
#include "base/mutex.h"
#include "runtime/runtime.h"
#include "runtime/tag_share.h"

namespace vmstash::share {

struct ShareOptions {
  std::string dir;                // empty: control::DefaultRuntimeDir()
  int revoke_timeout_ms = 10000;  // an importer's acknowledgement of a revoke
  int request_timeout_ms = 5000;  // a new importer's map request, and any other acknowledgement
  // Which peer uids may connect (default: our own uid only).
  std::function<bool(uid_t)> peer_allowed;
};

class TagExporter : public TransitionObserver {
 public:
  // Serves the socket; `runtime` must outlive the exporter (the caller makes it the
  // runtime's observer, and clears that before destroying the exporter).
  static absl::StatusOr<std::shared_ptr<TagExporter>> Start(Runtime* runtime, ShareOptions options);
  ~TagExporter() override;  // Stop()
  TagExporter(const TagExporter&) = delete;
  TagExporter& operator=(const TagExporter&) = delete;

  // Stops taking importers and closes every importer's connection (they unmap); removes
  // the socket. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(ops_mu_);
  // fork() (Note [Fork] in process.h): the process runtime holds the descriptors' lock
  // across a fork, and the child closes its copies of every descriptor (the listening
  // socket, the importers' connections), so that a dropped importer sees its connection
  // close even while a forked child of this process lives. The child's copy of the
  // exporter is never used or destroyed.
  void LockForFork() ABSL_NO_THREAD_SAFETY_ANALYSIS { fds_mu_.lock(); }
  void UnlockAfterFork() ABSL_NO_THREAD_SAFETY_ANALYSIS { fds_mu_.unlock(); }
  void CloseInForkedChild() ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Lets importers map `tag` from now on, by the name `name` (empty: the tag's own; a
  // framework's name for it, e.g. "weights" for the vLLM backend's "vllm.weights"),
  // publishes `index` (JSON text, opaque here: ShareIndexPath under that name) and returns
  // the tag's new generation (1, 2, ...: bumped by each Share, sent with every grant).
  // NotFound for a tag never declared here; FailedPrecondition when this process's chunks
  // are not exportable (AllocatorOptions::share_chunks off) or the name is another shared
  // tag's; InvalidArgument for an index that is not JSON; the file system's error (the
  // generation unchanged).
  absl::StatusOr<std::uint64_t> Share(TagId tag, const std::string& index = "[]", const std::string& name = "")
      ABSL_LOCKS_EXCLUDED(ops_mu_);
  // Stops sharing `tag`: its importers' connections are closed. NotFound when not shared.
  absl::Status Unshare(TagId tag) ABSL_LOCKS_EXCLUDED(ops_mu_);
  // Importers of `tag` connected now.
  std::size_t importers(TagId tag) const ABSL_LOCKS_EXCLUDED(ops_mu_);
  const std::string& socket_path() const { return path_; }

  absl::Status BeforeChunksChange(const ChunkChange& change) override ABSL_LOCKS_EXCLUDED(ops_mu_);
  void AfterChunksChange(const ChunkChange& change) override ABSL_LOCKS_EXCLUDED(ops_mu_);

 private:
  struct Importer {
    int fd = -1;
    pid_t pid = 0;
    int device = 0;        // our ordinal of its device
    bool granted = false;  // holds our chunks (or a paused tag's backup) now
    bool backup = false;   // granted a paused tag's backup (it may write it)
  };
  struct SharedTag {
    std::string name;  // the importers' name for it
    std::uint64_t generation = 0;
    std::vector<Importer> importers;
  };

  TagExporter(Runtime* runtime, ShareOptions options, int listen_fd, int wake[2], std::string path);
  void Loop();
  // A new connection: its map request, then a grant (or "paused", or an error).
  void Admit(int fd) ABSL_LOCKS_EXCLUDED(ops_mu_);
  // Our ordinal of the device with `uuid`, where this process uses it.
  absl::StatusOr<int> DeviceOf(const std::string& uuid) const;
  // Sends `tag`'s present chunks on `device` to `importer` — or, the tag paused with its
  // backup in the node pool, its backup; or "paused" with the reason it has neither to
  // give — and reads the acknowledgement: OK when it took them (granted set).
  absl::Status Grant(TagId tag, SharedTag& shared, Importer& importer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // Revokes the grants of `shared`'s importers on `device` (-1: any) — those that map its
  // chunks when `mapped`, those that write its backup when `backup` — and waits for them
  // (Note [Mapped Tags]): FailedPrecondition naming one alive that did not let go in time;
  // it is dropped, as is every importer gone — a backup writer alive into fenced_ (its
  // copies may be in flight).
  absl::Status Revoke(TagId tag, SharedTag& shared, int device, bool mapped, bool backup)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // Waits until `deadline` for `importer`'s acknowledgement of a revoke, in slices (a
  // process that dies meanwhile is seen gone within one): OK when it acknowledged;
  // Unavailable when its connection closed or its process is gone; DeadlineExceeded;
  // Internal when it answered something else.
  absl::Status AwaitRevokeAck(const Importer& importer, std::chrono::steady_clock::time_point deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // Revoke of the backup's writers, its failure logged (`why`: what is happening).
  void LetGo(TagId tag, SharedTag& shared, const char* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // Waits (one revoke_timeout_ms) for the fenced writers of `tag` on `device` (-1: any) to
  // acknowledge their revoke or exit, closing those that did; FailedPrecondition naming one
  // still silent.
  absl::Status WaitFenced(TagId tag, int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // The packets of a backup grant of paused `tag`, or why there is none.
  absl::Status BackupGrant(CachingAllocator& allocator, TagId tag, std::uint64_t generation,
                           std::vector<std::string>* packets) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // One event and its acknowledgement `ack` within `timeout_ms` (the chunks' descriptors
  // with a grant).
  absl::Status Exchange(Importer& importer, const std::string& ack, int timeout_ms,
                        const std::vector<std::string>& packets, const std::vector<std::vector<int>>& fds)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // Calls between Before and After, by the tags whose chunks they may release or whose
  // backups they may read (shared or not: a tag shared meanwhile is still in that call):
  // a new importer is told "paused".
  void Mark(const ChunkChange& change, int delta);
  bool Changing(TagId tag);
  // The shared tags a change concerns.
  std::vector<TagId> Concerned(const ChunkChange& change, bool regrant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // Shuts the connection down (a copy held by a forked child cannot keep it open) and
  // closes it.
  void Close(Importer& importer);
  void Track(int fd);  // fds_, for CloseInForkedChild
  // Writes the index file of `tag` (ShareIndexPath) atomically.
  absl::Status WriteIndex(const std::string& name, std::uint64_t generation, const std::string& index) const;

  Runtime* const runtime_;
  const ShareOptions options_;
  const int listen_fd_;
  const int wake_read_, wake_write_;
  const std::string path_;
  const pid_t owner_pid_;
  mutable Mutex ops_mu_;
  std::mutex fds_mu_;       // the importers' connections open now (a leaf lock)
  std::set<int> fds_;
  std::atomic<int> shared_count_{0};  // tags shared now: a change with none takes no ops_mu_
  std::mutex changing_mu_;  // a leaf lock
  std::map<TagId, int> changing_;  // Mark's counts
  int changing_all_ = 0;           // calls that may release every tag's chunks
  std::map<TagId, SharedTag> shared_ ABSL_GUARDED_BY(ops_mu_);
  // Backup writers dropped without letting go, by tag (shared or not any more): Revoke.
  std::map<TagId, std::vector<Importer>> fenced_ ABSL_GUARDED_BY(ops_mu_);
  std::atomic<bool> any_fenced_{false};  // fenced_ is not empty (written under ops_mu_)
  bool stopped_ ABSL_GUARDED_BY(ops_mu_) = false;
  std::thread thread_;
};

}  // namespace vmstash::share

#endif  // VMSTASH_RUNTIME_TAG_EXPORTER_H_
