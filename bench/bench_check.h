// BENCH_CHECK: in a benchmark's int-returning function, prints a failed status with the
// expression that produced it and returns 1 (a benchmark stops at its first error).
#ifndef VMSTASH_BENCH_BENCH_CHECK_H_
#define VMSTASH_BENCH_BENCH_CHECK_H_

#include <cstdio>

#include "absl/status/status.h"

#define BENCH_CHECK(expr)                                                \
  do {                                                                   \
    absl::Status _s = (expr);                                            \
    if (!_s.ok()) {                                                      \
      std::fprintf(stderr, "%s: %s\n", #expr, _s.ToString().c_str()); \
      return 1;                                                          \
    }                                                                    \
  } while (0)

#endif  // VMSTASH_BENCH_BENCH_CHECK_H_
