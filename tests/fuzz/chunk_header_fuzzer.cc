// libFuzzer harness for the 32-byte chunk header (kernels/wire_format.h): ParseChunkHeader on
// arbitrary bytes, then ValidateChunkHeader against a plan. Aborts if a header that parses does not
// re-encode to the same 32 bytes (the parser and writer disagree about the layout) or if a parsed
// header announces more payload than the input holds.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/wire_format.h"
#include "tests/fuzz/codec_fuzz_case.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dynamiq::kernels;
  // Exact-size copy so a read past the input is a heap overflow.
  dynamiq::fuzz::ExactBuffer<uint8_t> in(data, size);
  absl::StatusOr<ChunkHeader> h = ParseChunkHeader(in.cspan());
  if (!h.ok()) return 0;
  if (size < kChunkHeaderBytes || h->payload_bytes > size - kChunkHeaderBytes) {
    fprintf(stderr, "ParseChunkHeader accepted %zu bytes announcing %u payload bytes\n", size, h->payload_bytes);
    abort();
  }
  uint8_t again[kChunkHeaderBytes];
  WriteChunkHeader(*h, absl::MakeSpan(again));
  if (memcmp(again, data, kChunkHeaderBytes) != 0) {
    fprintf(stderr, "ParseChunkHeader/WriteChunkHeader do not round-trip\n");
    abort();
  }
  // The receiver's checks against what it expects (the header's own values and a fixed plan).
  BucketPlan plan;
  plan.round.round = h->round;
  plan.num_elements = h->num_elements;
  ChunkRef chunk;
  chunk.chunk_id = h->chunk_id;
  chunk.count = h->num_elements;
  if (!ValidateChunkHeader(*h, h->codec, plan, chunk, h->payload_bytes).ok()) {
    fprintf(stderr, "ValidateChunkHeader rejects a header against its own values\n");
    abort();
  }
  ChunkRef other;
  other.count = 1000;
  (void)ValidateChunkHeader(*h, CodecId::kDynamiq, BucketPlan{}, other, 40);
  return 0;
}
