// Status propagation macros.
//
// Debian 12's abseil (20220623) ships absl::Status/StatusOr but no propagation macros,
// so the project defines its own. Each expansion uses a temporary named with
// __COUNTER__, so two uses on one line or nested uses never collide.
//
//   VMSTASH_RETURN_IF_ERROR(driver.Map(va, size, chunk));
//   VMSTASH_ASSIGN_OR_RETURN(DevicePtr va, driver.ReserveAddress(0, size, 0));
//
// Both work in functions returning absl::Status or any absl::StatusOr<T>.
#ifndef VMSTASH_BASE_STATUS_MACROS_H_
#define VMSTASH_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define VMSTASH_CONCAT_INNER_(a, b) a##b
#define VMSTASH_CONCAT_(a, b) VMSTASH_CONCAT_INNER_(a, b)

#define VMSTASH_RETURN_IF_ERROR(expr) \
  VMSTASH_RETURN_IF_ERROR_IMPL_(VMSTASH_CONCAT_(vmstash_status_, __COUNTER__), expr)
#define VMSTASH_RETURN_IF_ERROR_IMPL_(tmp, expr) \
  do {                                           \
    ::absl::Status tmp = (expr);                 \
    if (!tmp.ok()) return tmp;                   \
  } while (0)

#define VMSTASH_ASSIGN_OR_RETURN(lhs, rexpr) \
  VMSTASH_ASSIGN_OR_RETURN_IMPL_(VMSTASH_CONCAT_(vmstash_statusor_, __COUNTER__), lhs, rexpr)
#define VMSTASH_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                   \
  if (!tmp.ok()) return std::move(tmp).status();        \
  lhs = std::move(tmp).value()

#endif  // VMSTASH_BASE_STATUS_MACROS_H_
