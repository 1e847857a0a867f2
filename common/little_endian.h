// Little-endian integers in byte buffers: how every dynamiq wire header (the step header, the UDP
// datagram, the TCP transport's frame and hello, the codecs' chunk header) lays out its fields,
// whatever the host's byte order. Put/Get read and write exactly sizeof(T) bytes at `p`, which the
// caller has bounds-checked; no alignment is needed.
#ifndef DQ_COMMON_LITTLE_ENDIAN_H_
#define DQ_COMMON_LITTLE_ENDIAN_H_

#include <stddef.h>
#include <stdint.h>

#include <type_traits>

namespace dynamiq::common {

template <typename T>
void PutLe(uint8_t* p, T v) {
  static_assert(std::is_unsigned_v<T> && sizeof(T) <= 8);
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
}

template <typename T>
T GetLe(const uint8_t* p) {
  static_assert(std::is_unsigned_v<T> && sizeof(T) <= 8);
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<T>(v);
}

}  // namespace dynamiq::common

#endif  // DQ_COMMON_LITTLE_ENDIAN_H_
