// The allocator's VMSTASH_CONF keys: see allocator_options.h.
#include "allocator/allocator_options.h"

#include <cstdint>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/conf.h"

namespace vmstash {

absl::Status ApplyAllocatorOption(absl::string_view key, absl::string_view value, AllocatorOptions& options) {
  if (key == "bypass" || key == "auto_prepare" || key == "switch_zero" || key == "share_chunks") {
    absl::StatusOr<bool> flag = ParseConfFlag(key, value);
    if (!flag.ok()) return flag.status();
    (key == "bypass"         ? options.bypass
     : key == "auto_prepare" ? options.auto_prepare
     : key == "switch_zero"  ? options.switch_zero
                             : options.share_chunks) = *flag;
  } else if (key == "backup") {
    if (value == "pinned" || value == "pageable") {
      options.backup_store = BackupStore{*ParseBackupStoreKind(value), ""};
    } else if (absl::StartsWith(value, "disk:") && value.size() > 5) {
      options.backup_store = BackupStore{BackupStore::Kind::kDisk, std::string(value.substr(5))};
    } else {
      return BadConfValue(key, value, "expected pinned, pageable or disk:<directory>");
    }
  } else if (key == "spill_dir") {
    if (value.empty()) return BadConfValue(key, value, "expected an existing directory");
    // The same check as a disk backup store's directory, named for this key.
    absl::Status exists = CheckBackupStore(BackupStore{BackupStore::Kind::kDisk, std::string(value)});
    if (!exists.ok()) {
      return absl::Status(exists.code(), absl::StrCat("VMSTASH_CONF: bad value '", value, "' for key '", key,
                                                      "': ", exists.message()));
    }
    options.spill_dir = std::string(value);
  } else if (key == "min_chunk" || key == "max_chunk" || key == "heap_va" || key == "host_max") {
    absl::StatusOr<std::uint64_t> size = ParseSize(value);
    if (!size.ok()) return BadConfValue(key, value, size.status().message());
    if (key == "heap_va" || key == "host_max") {
      (key == "heap_va" ? options.heap_va_bytes : options.host_max_bytes) = *size;
    } else if (*size == 0) {
      return BadConfValue(key, value, "must be > 0");
    } else {
      (key == "min_chunk" ? options.min_chunk_bytes : options.max_chunk_bytes) = *size;
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("ApplyAllocatorOption: '", key, "' is not an allocator key"));
  }
  return absl::OkStatus();
}

void AppendAllocatorOptions(const AllocatorOptions& options, std::string* out) {
  absl::StrAppend(out, out->empty() ? "" : ",", "bypass:", options.bypass ? 1 : 0,
                  ",min_chunk:", SizeToString(options.min_chunk_bytes),
                  ",max_chunk:", SizeToString(options.max_chunk_bytes), ",heap_va:", SizeToString(options.heap_va_bytes),
                  ",backup:", DescribeBackupStore(options.backup_store),
                  ",auto_prepare:", options.auto_prepare ? 1 : 0, ",switch_zero:", options.switch_zero ? 1 : 0,
                  ",host_max:", SizeToString(options.host_max_bytes), ",share_chunks:", options.share_chunks ? 1 : 0);
  if (!options.spill_dir.empty()) absl::StrAppend(out, ",spill_dir:", options.spill_dir);
}

absl::Status CheckChunkBounds(const AllocatorOptions& options) {
  if (options.min_chunk_bytes != 0 && options.max_chunk_bytes >= options.min_chunk_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("CachingAllocator: need 0 < min_chunk <= max_chunk, got ",
                                                 options.min_chunk_bytes, " and ", options.max_chunk_bytes));
}

}  // namespace vmstash
