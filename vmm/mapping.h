// Mapping: transactional RAII mapping of a run of chunks at a fixed VA.
//
// Create() maps chunks back to back from `va` (each whole), then grants the device
// read/write access piece by piece. The state of every piece (unmapped, mapped,
// accessible) is tracked, so a failure at any step is rolled back exactly: the pieces
// mapped so far are unmapped in reverse order and the original error is returned; the VA
// and the chunks are left as they were. (If the driver also refuses an unmap during
// rollback, that piece is logged as an error and stays mapped; the driver's leak check
// shows it. No real driver has been seen to do this.)
//
// The Mapping does not own the chunks or the reservation; it must be destroyed (or
// Unmap()ed) before them. Unmap() undoes pieces last to first and stops at the first
// failure, keeping the pieces still mapped, so a retry continues where it stopped. The
// destructor calls Unmap() and never fails: it logs a refused unmap. See PyTorch
// #188008/#191076 for the failure this design rules out (a throwing unmap in a destructor).
#ifndef VMSTASH_VMM_MAPPING_H_
#define VMSTASH_VMM_MAPPING_H_

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "vmm/chunk.h"
#include "vmm/driver.h"

namespace vmstash {

class Mapping {
 public:
  enum class PieceState { kUnmapped, kMapped, kAccessible };
  struct Piece {
    DevicePtr va = 0;
    std::size_t size_bytes = 0;
    ChunkHandle chunk = 0;
    PieceState state = PieceState::kUnmapped;
  };

  Mapping() = default;
  static absl::StatusOr<Mapping> Create(Driver* driver, int device, DevicePtr va, absl::Span<const Chunk> chunks);
  ~Mapping();
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  absl::Status Unmap();

  bool mapped() const { return !pieces_.empty(); }
  DevicePtr address() const { return pieces_.empty() ? 0 : pieces_.front().va; }
  std::size_t size_bytes() const;
  const std::vector<Piece>& pieces() const { return pieces_; }

 private:
  Mapping(Driver* driver, int device, std::vector<Piece> pieces)
      : driver_(driver), device_(device), pieces_(std::move(pieces)) {}

  Driver* driver_ = nullptr;
  int device_ = 0;
  std::vector<Piece> pieces_;  // pieces still (at least partly) mapped, in VA order
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_MAPPING_H_
