// libFuzzer harness for one codec's decoders (built once per codec, DQ_FUZZ_CODEC = its CodecId):
// Decompress, DecompressAccumulate and DecompressAccumulateRecompress on a received chunk a peer
// could have forged. The first kCaseParamBytes bytes choose the configuration, bucket, plan and
// chunk (tests/fuzz/codec_fuzz_case.h); the rest is the chunk, raw or as edits of a valid encoding.
//
// Every input runs on one of the CPU's Highway SIMD targets (chosen by the parameters: the codecs
// ship all of them and dispatch at runtime), and again on the portable EMU128 target, which must
// give bit-identical results (the SIMD kernels promise the scalar reference's bytes).
//
// Besides AddressSanitizer/UBSan findings, the harness aborts when the decoders disagree with each
// other, with the encoder, or across SIMD targets:
//   - Decompress and DecompressAccumulate accept exactly the same inputs;
//   - DAR accepts only inputs Decompress accepts, writes at most MaxEncodedBytes, and what it
//     writes decodes;
//   - an unedited valid encoding decodes;
//   - the selected target and EMU128 decode to the same values and re-encode to the same bytes.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "hwy/targets.h"
#include "kernels/codec.h"
#include "tests/fuzz/codec_fuzz_case.h"

#ifndef DQ_FUZZ_CODEC
#error "compile with -DDQ_FUZZ_CODEC=<CodecId value>"
#endif

namespace dynamiq::fuzz {
namespace {

constexpr kernels::CodecId kCodec = static_cast<kernels::CodecId>(DQ_FUZZ_CODEC);

[[noreturn]] void Fail(const char* what, const absl::Status& status) {
  fprintf(stderr, "codec_fuzzer(%s): %s: %s\n", std::string(kernels::CodecName(kCodec)).c_str(), what,
          status.ToString().c_str());
  abort();
}

// The Highway targets this CPU supports, best first; the last is the portable reference.
const std::vector<int64_t>& Targets() {
  static const auto* targets = new std::vector<int64_t>(hwy::SupportedAndGeneratedTargets());
  return *targets;
}

// The target this input runs on (the parameters pick it).
int64_t ChosenTarget(const CodecFuzzCase& c) {
  const std::vector<int64_t>& targets = Targets();
  return targets[c.simd_target % targets.size()];
}

struct Decoded {
  absl::Status decompressed, accumulated;
  absl::StatusOr<size_t> dar;
  ExactBuffer<uint8_t> dest, acc, out;
  Decoded(size_t dest_bytes, size_t acc_bytes, size_t out_bytes) : dest(dest_bytes), acc(acc_bytes), out(out_bytes) {}
};

// Runs the three decoders on `in` with the current SIMD target and checks that they agree.
std::unique_ptr<Decoded> RunDecoders(const CodecFuzzCase& c, const ExactBuffer<uint8_t>& in) {
  const kernels::Codec& codec = *c.codec;
  const size_t max_bytes = codec.MaxEncodedBytes(c.plan, c.chunk);
  auto d = std::make_unique<Decoded>(c.chunk.count * kernels::DTypeSize(c.dest_dtype), 4 * c.chunk.count, max_bytes);
  d->decompressed = codec.Decompress(c.plan, c.chunk, in.cspan(), c.Dest(d->dest.data.get()));

  float* acc = reinterpret_cast<float*>(d->acc.data.get());
  for (size_t i = 0; i < c.chunk.count; ++i) acc[i] = static_cast<float>(i % 7) - 3.0f;
  d->accumulated = codec.DecompressAccumulate(c.plan, c.chunk, in.cspan(), acc);
  if (d->decompressed.ok() != d->accumulated.ok()) {
    Fail("Decompress and DecompressAccumulate disagree", d->decompressed.ok() ? d->accumulated : d->decompressed);
  }

  d->dar = codec.DecompressAccumulateRecompress(c.plan, c.dar_chunk, in.cspan(), c.Source(), d->out.span());
  if (d->dar.ok()) {
    if (!d->decompressed.ok()) Fail("DAR accepted a chunk Decompress rejects", d->decompressed);
    if (*d->dar > max_bytes) Fail("DAR wrote more than MaxEncodedBytes", absl::OkStatus());
    ExactBuffer<uint8_t> next(d->out.data.get(), *d->dar);
    ExactBuffer<uint8_t> dest2(c.chunk.count * kernels::DTypeSize(c.dest_dtype));
    absl::Status redecoded = codec.Decompress(c.plan, c.chunk, next.cspan(), c.Dest(dest2.data.get()));
    if (!redecoded.ok()) Fail("DAR output does not decode", redecoded);
  }
  return d;
}

// Equal bytes, except that any two NaNs (fp32 or bf16 elements) count as equal.
bool SameValues(const ExactBuffer<uint8_t>& a, const ExactBuffer<uint8_t>& b, kernels::DType dtype) {
  if (a.size != b.size) return false;
  const size_t n = kernels::DTypeSize(dtype);
  for (size_t i = 0; i + n <= a.size; i += n) {
    if (memcmp(a.data.get() + i, b.data.get() + i, n) == 0) continue;
    uint32_t x = 0, y = 0;
    memcpy(&x, a.data.get() + i, n);
    memcpy(&y, b.data.get() + i, n);
    const uint32_t exp = n == 4 ? 0x7f800000u : 0x7f80u, man = n == 4 ? 0x007fffffu : 0x007fu;
    const bool x_nan = (x & exp) == exp && (x & man) != 0, y_nan = (y & exp) == exp && (y & man) != 0;
    if (!(x_nan && y_nan)) return false;
  }
  return true;
}

// Decodes `in` with all three decoders on the target the parameters chose, then on the portable
// reference target, and checks that they agree. Returns whether it decoded.
bool DecodeAll(const CodecFuzzCase& c, absl::Span<const uint8_t> in_bytes) {
  // Exact-size copy: reads past the chunk's end are heap overflows, not reads of spare capacity.
  ExactBuffer<uint8_t> in(in_bytes.data(), in_bytes.size());
  const std::vector<int64_t>& targets = Targets();
  const int64_t chosen = ChosenTarget(c);
  hwy::SetSupportedTargetsForTest(chosen);
  std::unique_ptr<Decoded> got = RunDecoders(c, in);
  if (chosen != targets.back()) {
    hwy::SetSupportedTargetsForTest(targets.back());
    std::unique_ptr<Decoded> want = RunDecoders(c, in);
    hwy::SetSupportedTargetsForTest(chosen);
    const std::string target = hwy::TargetName(chosen);
    if (got->decompressed.ok() != want->decompressed.ok() || got->dar.ok() != want->dar.ok()) {
      Fail(("SIMD target " + target + " and EMU128 disagree on acceptance").c_str(), got->decompressed);
    }
    if (got->decompressed.ok() && (!SameValues(got->dest, want->dest, c.dest_dtype) ||
                                   !SameValues(got->acc, want->acc, kernels::DType::kFloat32))) {
      Fail(("SIMD target " + target + " decodes to other values than EMU128").c_str(), absl::OkStatus());
    }
    if (got->dar.ok() &&
        (*got->dar != *want->dar || memcmp(got->out.data.get(), want->out.data.get(), *got->dar) != 0)) {
      Fail(("SIMD target " + target + " re-encodes to other bytes than EMU128").c_str(), absl::OkStatus());
    }
  }
  return got->decompressed.ok();
}

}  // namespace
}  // namespace dynamiq::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dynamiq::fuzz;
  if (size < kCaseParamBytes) return 0;
  absl::StatusOr<CodecFuzzCase> c = MakeCodecFuzzCase(kCodec, absl::MakeConstSpan(data, kCaseParamBytes));
  if (!c.ok()) return 0;  // MakePlan rejected hostile statistics: nothing to decode
  absl::Span<const uint8_t> rest(data + kCaseParamBytes, size - kCaseParamBytes);
  hwy::SetSupportedTargetsForTest(ChosenTarget(*c));  // the valid encoding below too
  if ((c->flags & kFlagMutate) == 0) {
    DecodeAll(*c, rest);
    return 0;
  }
  absl::StatusOr<std::vector<uint8_t>> valid = ValidEncoding(*c, (c->flags & kFlagAggregated) != 0);
  if (!valid.ok()) return 0;  // e.g. THC cannot encode Inf; DAR refuses a full world
  if (!DecodeAll(*c, *valid)) Fail("a valid encoding does not decode", absl::OkStatus());
  if (rest.empty()) return 0;
  ApplyEdits(rest, &*valid);
  DecodeAll(*c, *valid);
  return 0;
}
