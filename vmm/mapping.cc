#include "vmm/mapping.h"

#include <utility>

#include "absl/status/status.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {

absl::StatusOr<Mapping> Mapping::Create(Driver* driver, int device, DevicePtr va, absl::Span<const Chunk> chunks) {
  if (chunks.empty()) return absl::InvalidArgumentError("Mapping::Create: no chunks");
  std::vector<Piece> pieces;
  pieces.reserve(chunks.size());
  DevicePtr cursor = va;
  for (const Chunk& chunk : chunks) {
    if (!chunk.valid()) return absl::InvalidArgumentError("Mapping::Create: an empty (released) Chunk was given");
    pieces.push_back(Piece{cursor, chunk.size_bytes(), chunk.handle(), PieceState::kUnmapped});
    cursor += chunk.size_bytes();
  }
  absl::Status status = absl::OkStatus();
  for (Piece& piece : pieces) {
    status = driver->Map(piece.va, piece.size_bytes, piece.chunk);
    if (!status.ok()) break;
    piece.state = PieceState::kMapped;
  }
  if (status.ok()) {
    for (Piece& piece : pieces) {
      status = driver->SetAccess(piece.va, piece.size_bytes, device);
      if (!status.ok()) break;
      piece.state = PieceState::kAccessible;
    }
  }
  if (status.ok()) return Mapping(driver, device, std::move(pieces));
  // Roll back exactly what was done, newest first.
  for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
    if (it->state == PieceState::kUnmapped) continue;
    absl::Status undo = driver->Unmap(device, it->va, it->size_bytes);
    if (!undo.ok()) {
      VMSTASH_LOG(kError, "Mapping rollback: piece {:#x} (+{} bytes) stays mapped: {}", it->va, it->size_bytes,
                  undo.ToString());
    }
  }
  return status;
}

Mapping::~Mapping() {
  absl::Status status = Unmap();
  if (!status.ok()) VMSTASH_LOG(kError, "Mapping at {:#x} not fully unmapped: {}", address(), status.ToString());
}

Mapping::Mapping(Mapping&& other) noexcept
    : driver_(std::exchange(other.driver_, nullptr)), device_(other.device_), pieces_(std::move(other.pieces_)) {
  other.pieces_.clear();
}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    absl::Status status = Unmap();
    if (!status.ok()) VMSTASH_LOG(kError, "Mapping at {:#x} not fully unmapped: {}", address(), status.ToString());
    driver_ = std::exchange(other.driver_, nullptr);
    device_ = other.device_;
    pieces_ = std::move(other.pieces_);
    other.pieces_.clear();
  }
  return *this;
}

absl::Status Mapping::Unmap() {
  while (!pieces_.empty()) {
    const Piece& piece = pieces_.back();
    VMSTASH_RETURN_IF_ERROR(driver_->Unmap(device_, piece.va, piece.size_bytes));
    pieces_.pop_back();
  }
  return absl::OkStatus();
}

std::size_t Mapping::size_bytes() const {
  std::size_t total = 0;
  for (const Piece& piece : pieces_) total += piece.size_bytes;
  return total;
}

}  // namespace vmstash
