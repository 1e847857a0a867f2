// ClientEnv: every DQ_* environment variable the client library reads, parsed once.
//
// The client is configured only through these variables (a launcher such as torchrun or a job
// script sets them per worker process) and through the ClientOptions a program passes explicitly;
// no other part of dynamiq reads the environment (the daemon takes flags; dynamiqctl and the Python
// Control class read DQ_TOKEN_FILE, the operator token file, docs/security.md). Adding a variable means
// adding a field here, with its name, meaning and default in the field's comment.
//
// Owner: client library. Thread-safety: Get() parses the environment on first use (thread-safe,
// once per process) and returns an immutable object; Parse() is a pure function of its lookup.
#ifndef DQ_COMMON_ENV_H_
#define DQ_COMMON_ENV_H_

#include <stdint.h>

#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace dynamiq::common {

// Where dynamiqd listens for workers unless --worker_socket, DQ_SOCKET or ClientOptions says
// otherwise: "/run/dynamiq/dynamiqd.sock" for root (systemd's RuntimeDirectory), else
// "/tmp/dynamiq-<uid>/dynamiqd.sock". The folder is the user's own: dynamiqd refuses a socket
// folder that another user can write (docs/security.md). Daemon and workers of one user agree.
std::string DefaultWorkerSocket();
inline constexpr absl::string_view kDefaultJobId = "default";
inline constexpr int64_t kDefaultTimeoutSeconds = 300;

struct ClientEnv {
  // Env name: DQ_SOCKET. Path of dynamiqd's worker Unix socket (dynamiqd --worker_socket).
  // Default: DefaultWorkerSocket().
  std::string socket_path = DefaultWorkerSocket();

  // Env name: DQ_JOB. Job id: the workers of one training job (on every node) use the same id; the
  // daemon reduces only submissions of the same job together. Default: "default".
  std::string job_id = std::string(kDefaultJobId);

  // Env name: DQ_LOCAL_RANK. This worker's rank among the job's workers on this node, in
  // [0, DQ_LOCAL_WORLD_SIZE). torchrun's LOCAL_RANK is the usual source. Default: 0.
  uint32_t local_rank = 0;

  // Env name: DQ_LOCAL_WORLD_SIZE. How many workers of the job run on this node (>= 1); the daemon
  // waits for that many submissions of every tensor. Default: 1.
  uint32_t local_world_size = 1;

  // Env name: DQ_TIMEOUT_SECONDS. Deadline of every call the client makes to dynamiqd, including
  // an all-reduce from submission to completion, in seconds (a positive decimal number).
  // Default: 300.
  absl::Duration timeout = absl::Seconds(kDefaultTimeoutSeconds);

  // Env name: DQ_SUBMISSION_RING. Whether all-reduces go through the worker's submission ring in
  // shared memory (no gRPC call each) when the daemon offers one: 1/true or 0/false. Default: 1.
  bool submission_ring = true;

  // OK, or INVALID_ARGUMENT naming the first variable that is set but unusable (its value and
  // what was expected). The field of that variable keeps its default.
  absl::Status status;

  // Parses the variables through `lookup` (returns nullptr for an unset variable). Unset or empty
  // variables take the defaults above.
  static ClientEnv Parse(absl::FunctionRef<const char*(const char*)> lookup);

  // The process environment, parsed on first use; later changes to the environment are not seen.
  static const ClientEnv& Get();
};

}  // namespace dynamiq::common

#endif  // DQ_COMMON_ENV_H_
