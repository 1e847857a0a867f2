// The shared-memory layout of a submission ring (ipc/submission_ring_server.h, the daemon's end;
// ipc/submission_ring_client.h, the worker's), and the futex calls both ends wait and wake with.
// Internal to those two: nothing else reads the bytes.
//
// One ring per registered worker, created by the daemon (0600, unguessable name, like a buffer):
//
//   Header   magic, version, geometry; the submission counter `sq_head` (the daemon's doorbell), the
//            async-completion counter (the worker's reaper's doorbell), the closed flag and reason.
//   sq[]     `slots` slot indices, written by the worker in submission order.
//   Slot[]   `slots` slots of `slot_bytes`: a state word, the request (worker), the completion
//            (daemon), then a bitmap of the nodes that took part (num_nodes bits).
//
// A slot goes FREE -> SUBMITTED (the worker filled its request and pushed its index) -> DONE (the
// daemon wrote its completion) -> FREE (the worker read it). A thread that sleeps on a slot sets
// kWaiter first; the daemon wakes the slot's futex when it finds the bit set.
//
// The daemon trusts nothing the worker writes: it copies a request out once and checks the copy,
// keeps its own read position and its own record of the slots in flight, and never reads a slot's
// state. A worker that corrupts its ring can only break its own all-reduces.
#ifndef DQ_IPC_SUBMISSION_RING_LAYOUT_H_
#define DQ_IPC_SUBMISSION_RING_LAYOUT_H_

#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace dynamiq::ipc::ring {

inline constexpr uint64_t kMagic = 0x31474e4952514444;  // "DDQRING1", little endian
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kMaxSlots = 1024;
inline constexpr uint32_t kMaxNodes = uint32_t{1} << 20;
inline constexpr size_t kMaxNameBytes = 1024;     // the daemon's limit for tensor names
inline constexpr size_t kMaxMessageBytes = 4096;  // longer error messages arrive cut, marked so
inline constexpr size_t kMaxCodecBytes = 32;
inline constexpr size_t kMaxReasonBytes = 512;

// Slot states (the low two bits) and the sleeper bit.
inline constexpr uint32_t kFree = 0;
inline constexpr uint32_t kSubmitted = 1;
inline constexpr uint32_t kDone = 2;
inline constexpr uint32_t kStateMask = 3;
inline constexpr uint32_t kWaiter = 4;

// Request flags.
inline constexpr uint32_t kAverage = 1;
inline constexpr uint32_t kExact = 2;
inline constexpr uint32_t kHasWeight = 4;
inline constexpr uint32_t kAsync = 8;  // completed through the reaper's doorbell, not only the slot's

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint64_t slot_bytes;
  uint32_t num_nodes;  // bits in each slot's node bitmap
  uint32_t reserved;
  alignas(64) uint32_t sq_head;     // slot indices pushed so far (worker; wraps)
  uint32_t daemon_sleeping;         // the daemon sleeps on sq_head: wake it
  alignas(64) uint32_t async_done;  // async completions so far (daemon; wraps)
  uint32_t reaper_sleeping;         // the worker's reaper sleeps on async_done: wake it
  alignas(64) uint32_t closed;      // 1: the daemon closed the ring, for `reason`
  int32_t reason_code;              // absl::StatusCode
  uint32_t reason_bytes;
  char reason[kMaxReasonBytes];
};

struct SlotRequest {
  uint64_t submission;
  uint64_t buffer_id;
  uint64_t offset_bytes;
  uint64_t num_elements;
  double weight;
  uint32_t dtype;  // a dynamiq.v1.DType number
  uint32_t flags;
  uint32_t name_bytes;
  uint32_t reserved;
  char name[kMaxNameBytes];
};

struct SlotCompletion {
  int32_t code;  // absl::StatusCode
  uint32_t message_bytes;
  uint64_t sequence;
  uint64_t config_epoch;
  uint64_t wire_bytes;
  uint64_t contributors;
  double bits;
  double weight_sum;
  double measured_vnmse;
  uint32_t has_vnmse;
  uint32_t codec_bytes;
  uint32_t node_count;  // bits set in the bitmap that follows the slot
  uint32_t reserved;
  char codec[kMaxCodecBytes];
  char message[kMaxMessageBytes];
};

struct Slot {
  alignas(64) uint32_t state;
  SlotRequest request;
  SlotCompletion completion;
  // uint8_t nodes[(num_nodes + 7) / 8] follows.
};

// Where the parts of a ring of `slots` slots for `num_nodes` nodes lie.
struct Geometry {
  uint32_t slots = 0;
  uint32_t num_nodes = 0;
  size_t sq_offset = 0;
  size_t slot_offset = 0;
  size_t slot_bytes = 0;
  size_t total_bytes = 0;

  static Geometry Of(uint32_t slots, uint32_t num_nodes) {
    Geometry g;
    g.slots = slots;
    g.num_nodes = num_nodes;
    g.sq_offset = RoundUp(sizeof(Header));
    g.slot_offset = RoundUp(g.sq_offset + sizeof(uint32_t) * slots);
    g.slot_bytes = RoundUp(sizeof(Slot) + (size_t{num_nodes} + 7) / 8);
    g.total_bytes = g.slot_offset + g.slot_bytes * slots;
    return g;
  }
  static size_t RoundUp(size_t n) { return (n + 63) / 64 * 64; }
};

// What a worker asks for: one all-reduce, as the AllReduce RPC carries it.
struct RingRequest {
  uint64_t submission = 0;
  uint64_t buffer_id = 0;
  uint64_t offset_bytes = 0;
  uint64_t num_elements = 0;
  uint32_t dtype = 0;  // a dynamiq.v1.DType number
  bool average = false;
  bool exact = false;
  bool async = false;
  std::optional<double> weight;
  std::string tensor_name;
};

// What the daemon answers: the AllReduce RPC's status and response.
struct RingCompletion {
  absl::Status status;
  uint64_t sequence = 0;
  uint64_t config_epoch = 0;
  std::string codec;
  double bits = 0;
  uint64_t wire_bytes = 0;
  std::optional<double> measured_vnmse;
  uint64_t contributors = 0;
  double weight_sum = 0;
  std::vector<uint32_t> nodes;
};

// Futexes on the shared mapping: not FUTEX_PRIVATE_FLAG, the other end is another process.
inline std::atomic_ref<uint32_t> Atomic(uint32_t& word) { return std::atomic_ref<uint32_t>(word); }

// Sleeps while `word` holds `expected`, at most `timeout`; returns at once otherwise. Spurious
// wake-ups happen: callers re-check.
inline void FutexWait(uint32_t& word, uint32_t expected, absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  syscall(SYS_futex, &word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void FutexWakeAll(uint32_t& word) { syscall(SYS_futex, &word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

}  // namespace dynamiq::ipc::ring

#endif  // DQ_IPC_SUBMISSION_RING_LAYOUT_H_
