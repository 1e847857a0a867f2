// The framing of the TCP transport's connections (engine/tcp_mesh.h): every message is a 16-byte
// frame (tag, size: little-endian u64 each) followed by its payload. Two tags are the transport's
// own: kGaveUpTag (why the sender gave up on the exchange; the reason, UTF-8, and on a keyed
// connection its MAC follow) and kFenceTag (the sender's next messages belong to the session the
// 16-byte payload names). The engine's tags never come near either.
#ifndef DQ_ENGINE_TCP_FRAME_H_
#define DQ_ENGINE_TCP_FRAME_H_

#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "absl/types/span.h"

namespace dynamiq::engine::tcp_frame {

inline constexpr size_t kFrameBytes = 16;
inline constexpr uint64_t kGaveUpTag = ~uint64_t{0};
inline constexpr uint64_t kFenceTag = ~uint64_t{1};
inline constexpr size_t kFenceBytes = 16;  // epoch, sequence: little-endian u64 each

// A message's payload in several buffers, in order.
using Parts = std::vector<absl::Span<uint8_t>>;

size_t TotalBytes(const Parts& parts);

// Writes the frame of `parts` with `tag` and then the parts (one sendmsg where the socket takes it
// all), waiting as long as the socket needs; false on error (errno says which).
bool Write(int fd, uint64_t tag, const Parts& parts);

// The same without waiting: whether all of it went, none of it (the connection is still framed) or
// only a part (the connection's framing is lost: close it).
enum class WriteNowResult { kAll, kNone, kPart };
WriteNowResult WriteNow(int fd, uint64_t tag, const Parts& parts);

// Copies `bytes` into the parts, in order.
void Scatter(absl::Span<const uint8_t> bytes, const Parts& parts);

}  // namespace dynamiq::engine::tcp_frame

#endif  // DQ_ENGINE_TCP_FRAME_H_
