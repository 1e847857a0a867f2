// libFuzzer harness for the engine's 64-byte step header (engine/step_header.h) and its
// authentication (engine/step_auth.h): DecodeStepHeader on arbitrary bytes, MatchStepHeader against
// a fixed expectation and against itself, PayloadChecksum of what follows, and StepAuthenticator's
// Verify of the header with the rest of the input as the payload. Aborts if
//   - a header that decodes does not re-encode to the same 64 bytes or does not match itself;
//   - Verify accepts anything but exactly what Seal writes for that header, receiver and payload;
//   - a sealed header does not decode or verify, or still verifies with a changed payload.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <array>

#include "engine/step_auth.h"
#include "engine/step_header.h"
#include "tests/fuzz/codec_fuzz_case.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  fprintf(stderr, "step_header_fuzzer: %s\n", what);
  abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dynamiq::engine;
  using dynamiq::fuzz::kFuzzReceiver;
  static const auto* auth =
      StepAuthenticator::ForJob(dynamiq::fuzz::kFuzzClusterSecret, dynamiq::fuzz::kFuzzJob).release();
  dynamiq::fuzz::ExactBuffer<uint8_t> in(data, size);
  const size_t header_bytes = size < kStepHeaderBytes ? size : kStepHeaderBytes;
  const absl::Span<const uint8_t> header = in.cspan().subspan(0, header_bytes);
  const absl::Span<const uint8_t> payload = in.cspan().subspan(header_bytes);
  (void)PayloadChecksum(payload);
  // A receiver receives exactly 64 bytes; other sizes must be rejected, never read past.
  if (size != kStepHeaderBytes && DecodeStepHeader(in.cspan()).ok()) Fail("DecodeStepHeader accepted a wrong size");
  const bool verified = auth->Verify(header, kFuzzReceiver, payload);
  absl::StatusOr<StepHeader> h = DecodeStepHeader(header);
  if (!h.ok()) {
    if (verified) Fail("Verify accepted a header that does not decode");
    return 0;
  }
  const auto again = EncodeStepHeader(*h);
  if (memcmp(again.data(), data, kStepHeaderBytes) != 0) Fail("DecodeStepHeader/EncodeStepHeader do not round-trip");
  if (!MatchStepHeader(*h, *h).ok()) Fail("a step header does not match itself");
  StepHeader expected;
  expected.codec = 2;
  expected.bits_x1000 = 5000;
  expected.sender = 1;
  (void)MatchStepHeader(*h, expected);

  const std::array<uint8_t, kStepHeaderBytes> sealed = auth->Seal(*h, kFuzzReceiver, payload);
  if (verified && memcmp(sealed.data(), data, kStepHeaderBytes) != 0) Fail("Verify accepted a forged tag");
  absl::StatusOr<StepHeader> opened = DecodeStepHeader(sealed);
  if (!opened.ok() || !opened->authenticated) Fail("a sealed header does not decode as authenticated");
  if (!auth->Verify(sealed, kFuzzReceiver, payload)) Fail("a sealed header does not verify");
  if (auth->Verify(sealed, kFuzzReceiver + 1, payload)) Fail("a sealed header verifies for another receiver");
  if (!payload.empty()) {
    dynamiq::fuzz::ExactBuffer<uint8_t> changed(payload.data(), payload.size());
    changed.data[payload.size() / 2] ^= 1;
    if (auth->Verify(sealed, kFuzzReceiver, changed.cspan())) Fail("a sealed header verifies a changed payload");
  }
  return 0;
}
