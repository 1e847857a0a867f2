// libFuzzer harness for the daemon's end of a submission ring (ipc/submission_ring_server.h): a
// hostile worker writes what the input says anywhere in its ring, between the daemon's Wait(),
// Complete() and Close() calls. Aborts if
//   - Wait() hands out a slot index out of range, a slot already in flight, or a request with a
//     name longer than a slot holds without marking it bad;
//   - InFlight() disagrees with a plain model of the slots taken and completed (until the
//     protocol breaks);
//   - Wait() succeeds after it once reported the protocol broken.
// Crashes and sanitizer reports are findings too.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <memory>
#include <set>
#include <string>

#include "ipc/shm_region.h"
#include "ipc/submission_ring_server.h"

namespace {

using dynamiq::ipc::ShmRegion;
using dynamiq::ipc::SubmissionRingServer;
namespace ring = dynamiq::ipc::ring;

[[noreturn]] void Fail(const char* what) {
  fprintf(stderr, "submission_ring_fuzzer: %s\n", what);
  abort();
}

// Reads the input front to back; zeros once it runs out.
struct Input {
  const uint8_t* data;
  size_t size;
  size_t at = 0;
  bool empty() const { return at >= size; }
  uint8_t Byte() { return at < size ? data[at++] : 0; }
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{Byte()} << (8 * i);
    return v;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in{data, size};
  SubmissionRingServer::Options o;
  o.slots = 1 + in.Byte() % 8;
  o.num_nodes = 1 + in.Byte() % 70;
  o.name_hint = "fuzz";
  auto server = SubmissionRingServer::Create(o);
  if (!server.ok()) Fail("Create failed");
  auto raw = ShmRegion::Open((*server)->shm_name(), (*server)->bytes());
  if (!raw.ok()) Fail("cannot map the ring as the worker");
  (void)raw->Unlink();
  std::set<uint32_t> in_flight;  // the model
  bool broken = false;
  for (int op = 0; op < 64 && !in.empty(); ++op) {
    switch (in.Byte() % 4) {
      case 0: {  // the worker writes up to 64 bytes anywhere
        const size_t offset = in.U32() % raw->size();
        const size_t n = std::min<size_t>(in.Byte() % 65, raw->size() - offset);
        for (size_t i = 0; i < n; ++i) raw->data()[offset + i] = in.Byte();
        break;
      }
      case 1: {  // the worker submits slot k properly (index, then the head)
        const ring::Geometry g = ring::Geometry::Of(o.slots, o.num_nodes);
        ring::Header& h = *reinterpret_cast<ring::Header*>(raw->data());
        const uint32_t head = ring::Atomic(h.sq_head).load();
        reinterpret_cast<uint32_t*>(raw->data() + g.sq_offset)[head % o.slots] = in.Byte() % (o.slots + 1);
        ring::Atomic(h.sq_head).store(head + 1);
        break;
      }
      case 2: {  // the daemon takes what is there
        auto got = (*server)->Wait(absl::ZeroDuration());
        if (!got.ok()) {
          broken = true;
          break;
        }
        if (broken) Fail("Wait succeeded after the protocol was broken");
        for (const SubmissionRingServer::Submission& s : *got) {
          if (s.slot >= o.slots) Fail("a slot index out of range was handed out");
          if (!in_flight.insert(s.slot).second) Fail("a slot in flight was handed out again");
          if (s.request.tensor_name.size() > ring::kMaxNameBytes) Fail("a name longer than a slot");
        }
        break;
      }
      case 3: {  // the daemon answers a slot (in flight or not)
        ring::RingCompletion c;
        c.status = absl::Status(static_cast<absl::StatusCode>(in.Byte() % 17), std::string(in.Byte() * 40, 'm'));
        c.codec = std::string(in.Byte() % 50, 'c');
        for (int i = in.Byte() % 8; i > 0; --i) c.nodes.push_back(in.U32() % 100);
        const uint32_t slot = in.Byte() % (o.slots + 2);
        (*server)->Complete(slot, c);
        in_flight.erase(slot);
        break;
      }
    }
    // (A broken batch leaves the slots it took before the break in flight, answered by nobody.)
    if (!broken && (*server)->InFlight() != in_flight.size()) {
      Fail("InFlight disagrees with the slots taken and answered");
    }
  }
  (*server)->Stop();
  (*server)->Close(absl::UnavailableError("fuzz case over"));
  return 0;
}
