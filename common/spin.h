// A bounded busy wait: the latency path looks for an event for a few microseconds before it sleeps,
// because waking a sleeping thread costs tens of microseconds (more in a VM) and small all-reduces
// answer sooner than that.
#ifndef DQ_COMMON_SPIN_H_
#define DQ_COMMON_SPIN_H_

#include <sched.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace dynamiq::common {

// Tells the CPU this is a spin loop (x86 PAUSE, Arm YIELD): kinder to the sibling hyperthread.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls `done` (pausing, and yielding the core every 64 polls) until it returns true or `limit` has
// passed; returns whether it did.
template <typename Done>
bool SpinUntil(Done done, absl::Duration limit) {
  if (limit <= absl::ZeroDuration()) return done();
  const absl::Time until = absl::Now() + limit;
  do {
    for (int k = 0; k < 64; ++k) {
      if (done()) return true;
      CpuRelax();
    }
    // Lets a runnable thread have the core: on a machine with fewer cores than busy threads, the
    // thread being waited for may be the one that needs it.
    sched_yield();
  } while (absl::Now() < until);
  return done();
}

}  // namespace dynamiq::common

#endif  // DQ_COMMON_SPIN_H_
