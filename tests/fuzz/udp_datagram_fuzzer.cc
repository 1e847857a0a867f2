// libFuzzer harness for the UDP transport's datagram (engine/udp_datagram.h): ParseDatagram on
// arbitrary bytes as a receiver with the job's key and as one without (the checksum), and the
// ReplayWindow on sequences taken from the input. Aborts if
//   - an accepted datagram's payload is not within the input, its fields disagree with what was
//     expected (connection, ranks, length), or sealing its fields again does not give the input
//     byte for byte (so only what SealDatagram writes is ever accepted);
//   - a datagram sealed with the input as its payload does not parse back, or still parses with one
//     byte changed (at a place the input picks);
//   - the ReplayWindow accepts a sequence it accepted before, or one that is too old, or refuses a
//     new one within its window (checked against a plain model).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <set>
#include <vector>

#include "engine/step_auth.h"
#include "engine/udp_datagram.h"
#include "tests/fuzz/codec_fuzz_case.h"

namespace {

using namespace dynamiq::engine;

constexpr uint64_t kConnection = dynamiq::fuzz::kFuzzUdpConnection;
constexpr uint32_t kSize = dynamiq::fuzz::kFuzzUdpGroupSize;
constexpr size_t kMaxPayload = dynamiq::fuzz::kFuzzUdpMaxPayload;

[[noreturn]] void Fail(const char* what) {
  fprintf(stderr, "udp_datagram_fuzzer: %s\n", what);
  abort();
}

void CheckParse(absl::Span<const uint8_t> in, const DatagramKey& key) {
  const uint32_t receiver = dynamiq::fuzz::kFuzzReceiver;
  const ParsedDatagram p = ParseDatagram(in, key, receiver, kSize, kMaxPayload);
  if (p.verdict != DatagramVerdict::kAccepted) return;
  const DatagramHeader& h = p.header;
  if (p.payload.data() < in.data() || p.payload.data() + p.payload.size() > in.data() + in.size()) {
    Fail("an accepted payload lies outside the datagram");
  }
  if (h.connection != key.connection() || h.keyed != key.keyed() || h.source >= kSize || h.source == receiver ||
      h.destination != receiver || h.sequence == 0 || h.payload_bytes != p.payload.size() ||
      p.payload.size() > kMaxPayload) {
    Fail("an accepted datagram has fields it should have been dropped for");
  }
  const std::vector<uint8_t> again = SealDatagram(key, h.source, h.destination, h.tag, h.sequence, p.payload);
  if (again.size() != in.size() || memcmp(again.data(), in.data(), in.size()) != 0) {
    Fail("ParseDatagram accepted what SealDatagram does not write");
  }
}

void CheckSealed(absl::Span<const uint8_t> in, const DatagramKey& key) {
  const uint32_t receiver = dynamiq::fuzz::kFuzzReceiver;
  const absl::Span<const uint8_t> payload = in.subspan(0, kMaxPayload);
  uint64_t tag = 0;
  for (size_t i = 0; i < 8 && i < in.size(); ++i) tag |= uint64_t{in[i]} << (8 * i);
  const std::vector<uint8_t> sealed = SealDatagram(key, 0, receiver, tag, tag | 1, payload);
  dynamiq::fuzz::ExactBuffer<uint8_t> exact(sealed.data(), sealed.size());
  const ParsedDatagram p = ParseDatagram(exact.cspan(), key, receiver, kSize, kMaxPayload);
  if (p.verdict != DatagramVerdict::kAccepted || p.header.tag != tag || p.payload.size() != payload.size() ||
      (!payload.empty() && memcmp(p.payload.data(), payload.data(), payload.size()) != 0)) {
    Fail("a sealed datagram does not parse back");
  }
  const size_t at = in.empty() ? 0 : (in[in.size() - 1] * 131u + in.size()) % sealed.size();
  exact.data[at] ^= 1 << (in.size() % 8);
  if (ParseDatagram(exact.cspan(), key, receiver, kSize, kMaxPayload).verdict == DatagramVerdict::kAccepted) {
    Fail("a sealed datagram with a changed byte is still accepted");
  }
}

void CheckReplayWindow(absl::Span<const uint8_t> in) {
  ReplayWindow w;
  std::set<uint64_t> delivered;
  uint64_t highest = 0, position = 1;
  // Each pair of bytes moves a cursor forward (mostly) or back, far enough to leave the window.
  for (size_t i = 0; i + 1 < in.size(); i += 2) {
    const int64_t step = static_cast<int8_t>(in[i]) * static_cast<int64_t>(1 + in[i + 1] % 64);
    position = step < 0 && static_cast<uint64_t>(-step) >= position ? 1 : position + step;
    const bool fresh = position >= 1 && !delivered.count(position) &&
                       (position > highest || highest - position < ReplayWindow::kWindow);
    if (w.Accept(position) != fresh) Fail("ReplayWindow disagrees with the model");
    if (fresh) {
      delivered.insert(position);
      if (position > highest) highest = position;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto job_key = StepAuthenticator::KeyForJob(dynamiq::fuzz::kFuzzClusterSecret, dynamiq::fuzz::kFuzzJob);
  static const DatagramKey* const keyed = new DatagramKey(kConnection, job_key);
  static const DatagramKey* const checksum = new DatagramKey(kConnection, std::nullopt);
  dynamiq::fuzz::ExactBuffer<uint8_t> in(data, size);
  CheckParse(in.cspan(), *keyed);
  CheckParse(in.cspan(), *checksum);
  CheckSealed(in.cspan(), *keyed);
  CheckSealed(in.cspan(), *checksum);
  CheckReplayWindow(in.cspan());
  return 0;
}
