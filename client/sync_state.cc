#include "dynamiq/sync_state.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dynamiq {
namespace {

// Each worker's slot in the exchange of hashes: the hash and the size, each as four 16-bit chunks,
// which fp32 sums carry exactly (one worker writes a slot, the others add 0).
constexpr size_t kSlotFloats = 8;
constexpr uint64_t kMaxWorld = 65536;

void PutChunks(uint64_t v, float* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<float>((v >> (16 * i)) & 0xffff);
}

absl::StatusOr<uint64_t> GetChunks(const float* in) {
  uint64_t v = 0;
  for (int i = 0; i < 4; ++i) {
    const float f = in[i];
    if (!(f >= 0 && f <= 65535) || f != static_cast<float>(static_cast<uint32_t>(f))) {
      return absl::DataLossError("a malformed slot in the exchange of state hashes (two workers with one rank?)");
    }
    v |= static_cast<uint64_t>(f) << (16 * i);
  }
  return v;
}

}  // namespace

uint64_t StateHash(absl::Span<const uint8_t> bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

absl::StatusOr<SyncStateResult> SyncState(Client& client, const Buffer& buffer, size_t offset_bytes, size_t num_bytes,
                                          const SyncStateOptions& options) {
  if (!buffer.valid() || buffer.data() == nullptr) {
    return absl::InvalidArgumentError("sync_state needs a host buffer (device buffers: copy the state to host)");
  }
  if (num_bytes == 0 || offset_bytes > buffer.size() || num_bytes > buffer.size() - offset_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("sync_state of ", num_bytes, " bytes at ", offset_bytes,
                                                   " does not fit in a buffer of ", buffer.size()));
  }
  if (options.world == 0 || options.world > kMaxWorld || options.rank >= options.world) {
    return absl::InvalidArgumentError(
        absl::StrCat("sync_state: rank ", options.rank, " of ", options.world, " workers (at most ", kMaxWorld, ")"));
  }
  const uint8_t* mine = static_cast<const uint8_t*>(buffer.data()) + offset_bytes;
  const uint64_t hash = StateHash(absl::MakeConstSpan(mine, num_bytes));
  AllReduceOptions exact;
  exact.exact = true;

  // 1. Everyone's hash and size.
  absl::StatusOr<Buffer> slots = client.Allocate(options.world * kSlotFloats * sizeof(float));
  if (!slots.ok()) return slots.status();
  float* s = static_cast<float*>(slots->data());
  std::fill(s, s + options.world * kSlotFloats, 0.0f);
  PutChunks(hash, s + options.rank * kSlotFloats);
  PutChunks(num_bytes, s + options.rank * kSlotFloats + 4);
  AllReduceResult result;
  absl::Status exchanged = client.AllReduce(*slots, 0, options.world * kSlotFloats, DType::kFloat32,
                                            absl::StrCat(options.name, "/hashes"), exact, &result);
  if (!exchanged.ok()) return exchanged;
  if (result.contributors != options.world) {
    return absl::FailedPreconditionError(absl::StrCat("sync_state '", options.name, "' for ", options.world,
                                                      " workers, but ", result.contributors,
                                                      " took part in its collective"));
  }
  std::vector<uint64_t> hashes(options.world);
  for (uint64_t r = 0; r < options.world; ++r) {
    absl::StatusOr<uint64_t> h = GetChunks(s + r * kSlotFloats);
    absl::StatusOr<uint64_t> size = GetChunks(s + r * kSlotFloats + 4);
    if (!h.ok()) return h.status();
    if (!size.ok()) return size.status();
    if (*size != num_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("sync_state '", options.name, "': rank ", r, " holds ", *size,
                                                     " bytes, rank ", options.rank, " ", num_bytes,
                                                     " (every worker syncs the same tensors)"));
    }
    hashes[r] = *h;
  }
  // 2. The state most workers hold (a tie: the lowest rank's among the tied), from its lowest rank.
  std::map<uint64_t, uint64_t> votes;
  for (uint64_t h : hashes) ++votes[h];
  SyncStateResult out;
  out.source = options.world;
  for (uint64_t r = 0; r < options.world; ++r) {
    const uint64_t n = votes[hashes[r]];
    if (out.source == options.world || n > out.agreeing) {
      out.source = r;
      out.agreeing = n;
      out.hash = hashes[r];
    }
  }
  if (out.agreeing == options.world) return out;  // every worker holds it already

  // 3. Its bytes, as 16-bit integers in fp32: the source's, and 0 from everyone else; a window of
  //    them per all-reduce, so the floats take twice the window in shared memory, not twice the
  //    state. A worker that receives keeps the state aside until it is whole and hashes right.
  const size_t chunks = (num_bytes + 1) / 2;
  const size_t window = std::min(chunks, std::max<size_t>(1, options.window_bytes / 2));
  absl::StatusOr<Buffer> data = client.Allocate(window * sizeof(float));
  if (!data.ok()) return data.status();
  float* d = static_cast<float*>(data->data());
  const bool receives = hash != out.hash;
  std::vector<uint8_t> received(receives ? num_bytes : 0);
  for (size_t first = 0, k = 0; first < chunks; first += window, ++k) {
    const size_t n = std::min(window, chunks - first);
    if (options.rank == out.source) {
      for (size_t i = 0; i < n; ++i) {
        const size_t b = 2 * (first + i);
        const uint32_t lo = mine[b];
        const uint32_t hi = b + 1 < num_bytes ? mine[b + 1] : 0;
        d[i] = static_cast<float>(lo | (hi << 8));
      }
    } else {
      std::fill(d, d + n, 0.0f);
    }
    absl::Status sent = client.AllReduce(
        *data, 0, n, DType::kFloat32,
        k == 0 ? absl::StrCat(options.name, "/bytes") : absl::StrCat(options.name, "/bytes/", k), exact, &result);
    if (!sent.ok()) return sent;
    if (!receives) continue;
    for (size_t i = 0; i < n; ++i) {
      const float f = d[i];
      if (!(f >= 0 && f <= 65535)) return absl::DataLossError("sync_state: a malformed chunk of the state's bytes");
      const uint32_t v = static_cast<uint32_t>(f);
      const size_t b = 2 * (first + i);
      received[b] = static_cast<uint8_t>(v & 0xff);
      if (b + 1 < num_bytes) received[b + 1] = static_cast<uint8_t>(v >> 8);
    }
  }
  if (!receives) return out;
  if (StateHash(received) != out.hash) {
    return absl::DataLossError(absl::StrCat("sync_state '", options.name, "': the bytes received from rank ",
                                            out.source, " do not hash to its state"));
  }
  std::memcpy(static_cast<uint8_t*>(buffer.data()) + offset_bytes, received.data(), num_bytes);
  out.copied = true;
  return out;
}

}  // namespace dynamiq
