// DelayLine: the link emulator's delay and jitter, which this kernel has no qdisc for (no netem). A
// user-space line between pairs of network devices: every Ethernet frame one device of a pair
// receives is held for its direction's delay (plus jitter) and then sent out of the other device,
// through a FIFO per direction, so frames of a direction never overtake each other (jitter bends
// the delay, it never reorders; TCP would read reordering as loss). Rate is not its business (tc
// tbf on the devices around it does that), nor is loss (loss_filter.h).
//
// Frames travel with their virtio-net header (PACKET_VNET_HDR), so segmentation offload survives:
// a 64 KiB TSO frame is one frame here, and the kernel segments it where it must. A direction
// holds at most `queue_bytes`; a frame that does not fit is dropped and counted (a full line is a
// full buffer, as on a router).
//
// One thread (Run) does everything: ppoll on the receiving sockets with a timeout until the next
// frame is due, receive, timestamp, enqueue, send what is due. Needs CAP_NET_RAW (root).
#ifndef DQ_TOOLS_LINKEM_DELAY_LINE_H_
#define DQ_TOOLS_LINKEM_DELAY_LINE_H_

#include <stddef.h>
#include <stdint.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dynamiq::linkem {

struct DirectionSettings {
  absl::Duration delay;   // one way, added to every frame
  absl::Duration jitter;  // standard deviation of a normal variation of the delay (0: none)
};

// Two devices and what each direction between them does.
struct DevicePair {
  std::string a, b;
  DirectionSettings a_to_b, b_to_a;
};

struct DelayLineOptions {
  std::vector<DevicePair> pairs;
  uint64_t seed = 1;                      // of the jitter
  size_t queue_bytes = size_t{64} << 20;  // per direction
};

class DelayLine {
 public:
  struct DirectionStats {
    std::string from, to;
    uint64_t frames = 0, bytes = 0;
    uint64_t dropped_full = 0;  // no room in the direction's queue
    uint64_t send_errors = 0;   // the kernel refused a frame (counted, dropped)
    size_t max_queued_bytes = 0;
  };

  // Opens a socket on every device (they must exist and be up). INVALID_ARGUMENT for a device that
  // is not there or named twice, UNAVAILABLE with errno for socket errors.
  static absl::StatusOr<std::unique_ptr<DelayLine>> Open(const DelayLineOptions& options);
  ~DelayLine();
  DelayLine(const DelayLine&) = delete;
  DelayLine& operator=(const DelayLine&) = delete;

  // Forwards until `stop` is set (seen within 100 ms). UNAVAILABLE on a socket error.
  absl::Status Run(const std::atomic<bool>& stop);

  std::vector<DirectionStats> stats() const;

 private:
  struct Direction;
  DelayLine() = default;

  std::vector<std::unique_ptr<Direction>> directions_;  // 2 per pair: a->b, b->a
  std::vector<int> fds_;                                // one per device, in pair order (a, b, ...)
};

}  // namespace dynamiq::linkem

#endif  // DQ_TOOLS_LINKEM_DELAY_LINE_H_
