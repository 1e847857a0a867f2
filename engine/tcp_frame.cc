#include "engine/tcp_frame.h"

#include <errno.h>
#include <limits.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

#include "common/little_endian.h"

namespace dynamiq::engine::tcp_frame {
namespace {

// Fills `frame` for a message of `parts` with `tag`; the iovecs of the frame and the parts.
std::vector<iovec> FrameIovecs(uint8_t (&frame)[kFrameBytes], uint64_t tag, const Parts& parts) {
  common::PutLe<uint64_t>(frame, tag);
  common::PutLe<uint64_t>(frame + 8, TotalBytes(parts));
  std::vector<iovec> iov = {{frame, kFrameBytes}};
  for (absl::Span<uint8_t> part : parts) {
    if (!part.empty()) iov.push_back({part.data(), part.size()});
  }
  return iov;
}

}  // namespace

size_t TotalBytes(const Parts& parts) {
  size_t total = 0;
  for (absl::Span<uint8_t> part : parts) total += part.size();
  return total;
}

bool Write(int fd, uint64_t tag, const Parts& parts) {
  uint8_t frame[kFrameBytes];
  std::vector<iovec> iov = FrameIovecs(frame, tag, parts);
  iovec* next = iov.data();
  size_t count = iov.size();
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = next;
    msg.msg_iovlen = std::min<size_t>(count, IOV_MAX);
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    size_t sent = static_cast<size_t>(n);
    while (count > 0 && sent >= next->iov_len) {
      sent -= next->iov_len;
      ++next;
      --count;
    }
    if (count > 0) {
      next->iov_base = static_cast<uint8_t*>(next->iov_base) + sent;
      next->iov_len -= sent;
    }
  }
  return true;
}

WriteNowResult WriteNow(int fd, uint64_t tag, const Parts& parts) {
  uint8_t frame[kFrameBytes];
  std::vector<iovec> iov = FrameIovecs(frame, tag, parts);
  msghdr msg{};
  msg.msg_iov = iov.data();
  msg.msg_iovlen = std::min<size_t>(iov.size(), IOV_MAX);
  ssize_t n;
  do {
    n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK ? WriteNowResult::kPart : WriteNowResult::kNone;
  return static_cast<size_t>(n) == kFrameBytes + TotalBytes(parts) ? WriteNowResult::kAll : WriteNowResult::kPart;
}

void Scatter(absl::Span<const uint8_t> bytes, const Parts& parts) {
  for (absl::Span<uint8_t> part : parts) {
    const size_t n = std::min(part.size(), bytes.size());
    if (n > 0) std::memcpy(part.data(), bytes.data(), n);
    bytes.remove_prefix(n);
  }
}

}  // namespace dynamiq::engine::tcp_frame
