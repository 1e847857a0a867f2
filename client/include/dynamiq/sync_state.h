// SyncState: makes a worker's state (parameters, optimizer state, the step: any bytes) identical on
// every worker of the job, for a worker that joins a running job (a restarted node, docs/operations.md
// "Nodes that leave") or one that may have diverged. Include <dynamiq/client.h> first.
//
//   dynamiq::SyncStateOptions o{.rank = rank, .world = world};
//   absl::StatusOr<dynamiq::SyncStateResult> r = dynamiq::SyncState(*client, *buffer, 0, bytes, o);
//
// Every worker of the job calls it with its own bytes at the same point of its collectives. Each
// hashes its bytes (64-bit FNV-1a); the workers exchange their hashes and sizes (one exact
// all-reduce); the hash most workers hold wins (a tie: the one of the lowest rank among the tied),
// and the lowest rank holding it sends its bytes to every worker whose hash differs (a second exact
// all-reduce per window of `window_bytes`, the bytes as 16-bit integers in fp32, so they arrive bit
// for bit whatever the job's compression). When every hash agrees, nothing more is sent. Idempotent; bounded in time by
// the client's timeout per all-reduce.
#ifndef DQ_CLIENT_INCLUDE_DYNAMIQ_SYNC_STATE_H_
#define DQ_CLIENT_INCLUDE_DYNAMIQ_SYNC_STATE_H_

#include <stddef.h>
#include <stdint.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dynamiq/client.h"

namespace dynamiq {

struct SyncStateOptions {
  /// This worker's rank among the job's `world` workers (every worker a distinct one, as
  /// torch.distributed numbers them). world <= 65536.
  uint64_t rank = 0;
  uint64_t world = 1;
  /// Names the state's collectives ("<name>/hashes", "<name>/bytes", "<name>/bytes/<k>"): every
  /// worker passes the same.
  std::string name = "state";
  /// Bytes of state per all-reduce when it is copied (every worker passes the same): the copy
  /// takes twice this in shared memory, whatever the state's size.
  size_t window_bytes = size_t{32} << 20;
};

struct SyncStateResult {
  /// This worker's bytes were replaced by the chosen state.
  bool copied = false;
  /// The rank whose bytes every worker now holds, and how many workers held them already.
  uint64_t source = 0;
  uint64_t agreeing = 0;
  /// The chosen state's hash (64-bit FNV-1a of its bytes).
  uint64_t hash = 0;
};

/// Syncs `num_bytes` bytes at `offset_bytes` of `buffer` (host memory) as above. INVALID_ARGUMENT for
/// bad arguments or when the workers' sizes differ (every worker gets the same error, naming a
/// worker whose size differs), FAILED_PRECONDITION when the collective did not have `world` workers,
/// DATA_LOSS if the copied bytes do not hash to the chosen state; else the daemon's error.
absl::StatusOr<SyncStateResult> SyncState(Client& client, const Buffer& buffer, size_t offset_bytes, size_t num_bytes,
                                          const SyncStateOptions& options);

/// The hash SyncState compares: 64-bit FNV-1a of `bytes`.
uint64_t StateHash(absl::Span<const uint8_t> bytes);

}  // namespace dynamiq

#endif  // DQ_CLIENT_INCLUDE_DYNAMIQ_SYNC_STATE_H_
