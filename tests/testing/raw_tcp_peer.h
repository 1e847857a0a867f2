// A stranger on the TCP transport (engine/tcp_transport.h) for tests: raw connections to where a
// rank listens, raw bytes and frames sent as a hostile or broken peer would send them.
#ifndef DQ_TESTS_TESTING_RAW_TCP_PEER_H_
#define DQ_TESTS_TESTING_RAW_TCP_PEER_H_

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <sys/socket.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/tcp_socket.h"
#include "engine/store.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::testing {

// Little-endian bytes of `v` (`bytes` of them) and concatenation.
inline std::vector<uint8_t> LittleEndian(uint64_t v, int bytes) {
  std::vector<uint8_t> out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  return out;
}
inline std::vector<uint8_t> Cat(std::vector<uint8_t> a, const std::vector<uint8_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The hello magics (engine/tcp_hello.cc) and a frame (tag, size, payload; engine/tcp_transport.cc).
inline const std::vector<uint8_t> kPlainHelloMagic = LittleEndian(0x31544344, 4);
inline const std::vector<uint8_t> kKeyedHelloMagic = LittleEndian(0x32544344, 4);
inline std::vector<uint8_t> Frame(uint64_t tag, absl::string_view payload) {
  return Cat(Cat(LittleEndian(tag, 8), LittleEndian(payload.size(), 8)),
             std::vector<uint8_t>(payload.begin(), payload.end()));
}

// A connection to where rank `rank` listens (its "tcp/<rank>" store key), or -1 (and a failure).
inline int ConnectToRank(engine::Store& store, int rank) {
  absl::StatusOr<std::string> address = store.Get(absl::StrCat("tcp/", rank), absl::Seconds(10));
  EXPECT_THAT(address, IsOk());
  if (!address.ok()) return -1;
  auto host_port = common::SplitHostPort(*address);
  EXPECT_THAT(host_port, IsOk());
  if (!host_port.ok()) return -1;
  absl::StatusOr<int> fd =
      common::ConnectWithRetry(host_port->first, host_port->second, absl::Now() + absl::Seconds(10), "stranger");
  EXPECT_THAT(fd, IsOk());
  return fd.ok() ? *fd : -1;
}

inline bool SendRaw(int fd, const std::vector<uint8_t>& bytes) {
  return common::WriteFull(fd, absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                           absl::Now() + absl::Seconds(10), "stranger")
      .ok();
}

// Whether the other end closes `fd` within `within` (what it sends meanwhile is read and dropped).
inline bool ClosedByPeer(int fd, absl::Duration within = absl::Seconds(5)) {
  char sink[256];
  const absl::Time deadline = absl::Now() + within;
  while (absl::Now() < deadline) {
    if (!common::PollFd(fd, POLLIN, deadline, "stranger").ok()) return false;
    const ssize_t n = recv(fd, sink, sizeof(sink), 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
  return false;
}

}  // namespace dynamiq::testing

#endif  // DQ_TESTS_TESTING_RAW_TCP_PEER_H_
