// The measured compression error of sampled collectives (dynamiq_compression_error_vnmse).
//
// For a sampled collective a node keeps a copy of its local fp32 sum, runs the compressed
// cross-node all-reduce as usual, then runs an uncompressed (codec none) all-reduce of the copy
// over the same transport and compares: vNMSE = ||result - exact||^2 / ||exact||^2.
//
// Every node must take part in the same side all-reduces, so whether a collective is sampled is a
// pure function of (job id, sequence, rate) and the daemons agree on the rate (node 0's, through
// the coordinator's store). The side all-reduce runs under its own sequence number
// (ErrorProbeSequence), so its step headers and transport tags can never be taken for those of a
// real collective.
#ifndef DQ_SERVER_ERROR_PROBE_H_
#define DQ_SERVER_ERROR_PROBE_H_

#include <stddef.h>
#include <stdint.h>

#include <optional>

#include "absl/strings/string_view.h"

namespace dynamiq::server {

// True for a fraction `rate` (0..1) of (job, sequence) pairs, deterministically: a hash of both
// mapped to [0, 1) and compared with `rate`. rate <= 0: never; rate >= 1: always.
bool SampleForError(absl::string_view job_id, uint64_t sequence, double rate);

// The sequence number the side all-reduce of collective `sequence` runs under. Step headers carry
// all 64 bits: bit 63 is set, which no real collective reaches. The engine's transport tags keep
// the low 24 bits: bit 23 is flipped, so the tags differ from those of collectives sequence-1,
// sequence and sequence+1 (all a peer can be running while this node runs the side all-reduce).
uint64_t ErrorProbeSequence(uint64_t sequence);

// ||result - exact||^2 / ||exact||^2 over n values, accumulated in double. nullopt when undefined:
// ||exact||^2 == 0 or a non-finite value in either (e.g. a gradient overflow).
std::optional<double> Vnmse(const float* result, const float* exact, size_t n);

}  // namespace dynamiq::server

#endif  // DQ_SERVER_ERROR_PROBE_H_
