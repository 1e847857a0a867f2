// dq_fuzz_seeds OUT_DIR: writes the fuzzers' seed corpus, OUT_DIR/<fuzzer>/seed-NNN, so every
// fuzzer starts from inputs that pass the magic and header checks:
//   fuzz_codec_<codec>   valid leaf and aggregated (DAR) encodings of several buckets, raw and as
//                        mutate-mode inputs with no edits (tests/fuzz/codec_fuzz_case.h)
//   fuzz_chunk_header    the chunks above, and headers of every codec
//   fuzz_step_header     encoded step headers of every phase, plain and sealed, with a payload
//   fuzz_config          every codec name with its usual bits, topology and allocator
//   fuzz_udp_datagram    datagrams of several payload sizes to the fuzzer's receiver, keyed and
//                        checksummed
// Deterministic: the same build writes the same files.
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/step_auth.h"
#include "engine/step_header.h"
#include "engine/udp_datagram.h"
#include "kernels/codec.h"
#include "kernels/wire_format.h"
#include "tests/fuzz/codec_fuzz_case.h"

namespace dynamiq::fuzz {
namespace {

using Bytes = std::vector<uint8_t>;

class SeedWriter {
 public:
  explicit SeedWriter(std::string dir) : dir_(std::move(dir)) {}

  bool Add(const std::string& fuzzer, const Bytes& bytes) {
    const std::string dir = absl::StrCat(dir_, "/", fuzzer);
    mkdir(dir.c_str(), 0755);
    const std::string path = absl::StrFormat("%s/seed-%03d", dir, count_[fuzzer]++);
    FILE* f = fopen(path.c_str(), "wb");
    if (f == nullptr) {
      perror(path.c_str());
      return false;
    }
    const bool ok = fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    return fclose(f) == 0 && ok;
  }

  int total() const {
    int t = 0;
    for (const auto& [name, n] : count_) t += n;
    return t;
  }

 private:
  std::string dir_;
  std::map<std::string, int> count_;
};

// Parameter bytes (codec_fuzz_case.h) of one bucket.
Bytes Params(uint8_t variant, uint8_t flags, uint16_t elements, uint8_t world, uint8_t rank, uint8_t chunk_sg,
             uint16_t chunk_elements, uint32_t round, uint8_t seed) {
  Bytes p(kCaseParamBytes, 0);
  p[0] = variant;
  p[1] = flags;
  p[2] = static_cast<uint8_t>(elements);
  p[3] = static_cast<uint8_t>(elements >> 8);
  p[4] = static_cast<uint8_t>((world - 1) | (rank << 4));
  p[5] = chunk_sg;
  p[6] = static_cast<uint8_t>(chunk_elements);
  p[7] = static_cast<uint8_t>(chunk_elements >> 8);
  for (int i = 0; i < 4; ++i) p[8 + i] = static_cast<uint8_t>(round >> (8 * i));
  p[12] = 0x05;  // 2 siblings, index 1, group 0
  p[13] = seed;
  p[14] = 140;  // values of magnitude 1
  p[15] = 0;    // consistent statistics
  return p;
}

Bytes Concat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

bool WriteCodecSeeds(SeedWriter& out, std::vector<Bytes>* chunks) {
  struct Bucket {
    uint8_t flags;
    uint16_t elements;
    uint8_t world, rank, chunk_sg;
    uint16_t chunk_elements;
  };
  const Bucket buckets[] = {
      {0, 1000, 2, 1, 0, 1000},                            // whole bucket, partial last SG
      {kFlagMeans, 4096, 4, 2, 4, 2048},                   // a middle chunk, mean centring
      {kFlagDestBf16 | kFlagLocalBf16, 300, 3, 0, 1, 44},  // bf16 in and out, tail chunk
      {kFlagNonFinite, 512, 2, 0, 0, 512},                 // an Inf/NaN value
      {0, 16 * 256 + 100, 8, 7, 0, 16 * 256 + 100},        // the largest bucket
      {kFlagMeans | kFlagDestBf16, 257, 16, 5, 1, 1},      // one element
  };
  for (int id = 0; id < kernels::kNumCodecs; ++id) {
    const auto codec = static_cast<kernels::CodecId>(id);
    const std::string fuzzer = absl::StrCat("fuzz_codec_", kernels::CodecName(codec));
    int i = 0;
    for (const Bucket& b : buckets) {
      // A few configuration variants per bucket (bits, allocator, levels, rounding).
      for (int v = 0; v < 3; ++v, ++i) {
        const uint8_t variant = static_cast<uint8_t>((i * 37) % NumVariants(codec));
        const Bytes params = Params(variant, b.flags, b.elements, b.world, b.rank, b.chunk_sg, b.chunk_elements,
                                    1000 + i, static_cast<uint8_t>(i));
        absl::StatusOr<CodecFuzzCase> c = MakeCodecFuzzCase(codec, params);
        if (!c.ok()) continue;  // THC: an Inf value makes the global norm Inf, which MakePlan rejects
        for (bool aggregated : {false, true}) {
          absl::StatusOr<Bytes> chunk = ValidEncoding(*c, aggregated);
          if (!chunk.ok()) continue;  // THC cannot encode Inf; DAR may refuse a full world
          if (!out.Add(fuzzer, Concat(params, *chunk))) return false;
          chunks->push_back(*chunk);
          Bytes mutate = params;
          mutate[1] = static_cast<uint8_t>(mutate[1] | kFlagMutate | (aggregated ? kFlagAggregated : 0));
          if (!out.Add(fuzzer, mutate)) return false;
        }
      }
    }
  }
  return true;
}

bool WriteHeaderSeeds(SeedWriter& out, const std::vector<Bytes>& chunks) {
  for (size_t i = 0; i < chunks.size(); i += 7) {
    if (!out.Add("fuzz_chunk_header", chunks[i])) return false;
  }
  for (int id = 0; id < kernels::kNumCodecs; ++id) {
    kernels::ChunkHeader h;
    h.codec = static_cast<kernels::CodecId>(id);
    h.element_bits = 4;
    h.flags = kernels::kFlagCorrelated;
    h.num_elements = 256;
    h.payload_bytes = 8;
    h.param = 1.0f;
    Bytes bytes(kernels::kChunkHeaderBytes + h.payload_bytes, 0x11);
    kernels::WriteChunkHeader(h, absl::MakeSpan(bytes));
    if (!out.Add("fuzz_chunk_header", bytes)) return false;
  }
  const auto auth = engine::StepAuthenticator::ForJob(kFuzzClusterSecret, kFuzzJob);
  for (int phase = 0; phase < 3; ++phase) {
    engine::StepHeader h;
    h.phase = static_cast<engine::Phase>(phase);
    h.codec = 2;
    h.bits_x1000 = 5000;
    h.sender = 1;
    h.job_id = 0x1234567890abcdefull;
    h.config_epoch = 3;
    h.sequence = 42;
    h.step = 1;
    h.payload_bytes = 16;
    const Bytes payload(16, 0x5a);
    h.checksum = engine::PayloadChecksum(payload);
    const auto header = engine::EncodeStepHeader(h);
    if (!out.Add("fuzz_step_header", Concat(Bytes(header.begin(), header.end()), payload))) return false;
    const auto sealed = auth->Seal(h, kFuzzReceiver, payload);
    if (!out.Add("fuzz_step_header", Concat(Bytes(sealed.begin(), sealed.end()), payload))) return false;
  }
  return true;
}

bool WriteConfigSeeds(SeedWriter& out) {
  struct Config {
    const char* codec;
    double bits;
    const char* topology;
    const char* allocator;
  };
  const Config configs[] = {
      {"dynamiq", 5.0, "ring", "measured"},
      {"dynamiq", 3.0, "butterfly", "paper"},
      {"dynamiq", 7.5, "", ""},
      {"uniform", 4.0, "ring", ""},
      {"thc", 4.0, "ring", ""},
      {"global_qsgd", 8.0, "ring", ""},
      {"arc_topk", 0.1, "butterfly", ""},
      {"mxfp8", 0.0, "butterfly", ""},
      {"mxfp6", 0.0, "ring", ""},
      {"mxfp4", 0.0, "ring", ""},
      {"bf16", 0.0, "ring", ""},
      {"none", 0.0, "ring", ""},
  };
  for (const Config& c : configs) {
    for (uint8_t world : {uint8_t{4 | 128}, uint8_t{3}}) {
      Bytes b(20, 0);
      b[0] = 1;  // raw bits
      memcpy(b.data() + 1, &c.bits, 8);
      b[9] = world;
      b[10] = 0x00;  // 2560 elements: 10 super-groups
      b[11] = 0x0a;
      b[12] = 7;
      const std::string text = absl::StrCat(c.codec, "|", c.topology, "|", c.allocator, "|");
      b.insert(b.end(), text.begin(), text.end());
      for (int k = 0; k < 20; ++k) {  // statistics: (mean, norm) pairs
        const float v = (k % 2 == 0) ? 0.5f : 10.0f + k;
        const auto* p = reinterpret_cast<const uint8_t*>(&v);
        b.insert(b.end(), p, p + 4);
      }
      if (!out.Add("fuzz_config", b)) return false;
    }
  }
  return true;
}

bool WriteUdpDatagramSeeds(SeedWriter& out) {
  const engine::DatagramKey keyed(kFuzzUdpConnection,
                                  engine::StepAuthenticator::KeyForJob(kFuzzClusterSecret, kFuzzJob));
  const engine::DatagramKey checksum(kFuzzUdpConnection, std::nullopt);
  uint64_t sequence = 1;
  for (const engine::DatagramKey* key : {&keyed, &checksum}) {
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{64}, kFuzzUdpMaxPayload}) {
      Bytes payload(bytes);
      for (size_t i = 0; i < bytes; ++i) payload[i] = static_cast<uint8_t>(i * 7 + 3);
      const uint32_t source =
          static_cast<uint32_t>(sequence % kFuzzUdpGroupSize == kFuzzReceiver ? 0 : sequence % kFuzzUdpGroupSize);
      if (!out.Add("fuzz_udp_datagram",
                   engine::SealDatagram(*key, source, kFuzzReceiver, 1000 + bytes, sequence++, payload))) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace
}  // namespace dynamiq::fuzz

int main(int argc, char** argv) {
  using namespace dynamiq::fuzz;
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUT_DIR   (writes OUT_DIR/<fuzzer>/seed-NNN)\n", argv[0]);
    return 2;
  }
  mkdir(argv[1], 0755);
  SeedWriter out(argv[1]);
  std::vector<Bytes> chunks;
  if (!WriteCodecSeeds(out, &chunks) || !WriteHeaderSeeds(out, chunks) || !WriteConfigSeeds(out) ||
      !WriteUdpDatagramSeeds(out)) {
    return 1;
  }
  printf("dq_fuzz_seeds: wrote %d seeds under %s\n", out.total(), argv[1]);
  return 0;
}
