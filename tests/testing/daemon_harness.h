// Test support for end-to-end daemon tests: a scratch directory, in-process daemons forming a
// cluster on loopback, and workers driven through the raw gRPC worker API with mapped buffers.
#ifndef DQ_TESTS_TESTING_DAEMON_HARNESS_H_
#define DQ_TESTS_TESTING_DAEMON_HARNESS_H_

#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "ipc/shm_region.h"
#include "server/daemon.h"
#include "server/metrics.h"

namespace dynamiq::testing {

// A scratch directory (for worker sockets), removed with everything in it when destroyed.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/dqtest-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A worker as a test drives it: raw gRPC stub, its registration and one mapped fp32 buffer.
struct DaemonTestWorker {
  std::unique_ptr<dynamiq::v1::Worker::Stub> stub;
  std::string id;
  uint64_t buffer_id = 0;
  std::unique_ptr<ipc::ShmRegion> region;

  float* data() { return reinterpret_cast<float*>(region->data()); }

  // `submission`: the worker's own index of the request (unset: the daemon numbers it); `weight`:
  // its contribution's weight (unset: none).
  grpc::Status AllReduce(const std::string& name, uint64_t n, bool average = false,
                         dynamiq::v1::AllReduceResponse* response = nullptr,
                         std::optional<uint64_t> submission = std::nullopt,
                         std::optional<double> weight = std::nullopt) {
    dynamiq::v1::AllReduceRequest req;
    if (submission.has_value()) req.set_submission(*submission);
    if (weight.has_value()) req.set_weight(*weight);
    req.set_worker_id(id);
    req.set_tensor_name(name);
    req.set_buffer_id(buffer_id);
    req.set_num_elements(n);
    req.set_average(average);
    req.set_dtype(dynamiq::v1::DTYPE_FLOAT32);
    dynamiq::v1::AllReduceResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub->AllReduce(&ctx, req, response != nullptr ? response : &resp);
  }
};

// Registers local rank `rank` of `size` for `job` at `socket` and maps a buffer of `floats`.
inline absl::StatusOr<DaemonTestWorker> ConnectTestWorker(const std::string& socket, const std::string& job,
                                                          uint32_t rank, uint32_t size, size_t floats) {
  DaemonTestWorker w;
  w.stub = dynamiq::v1::Worker::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  auto fail = [](const char* what, const grpc::Status& s) {
    return absl::InternalError(absl::StrCat(what, ": ", s.error_message()));
  };
  dynamiq::v1::RegisterRequest reg;
  reg.set_job_id(job);
  reg.set_local_rank(rank);
  reg.set_local_world_size(size);
  dynamiq::v1::RegisterResponse reg_resp;
  grpc::ClientContext c1;
  if (grpc::Status s = w.stub->Register(&c1, reg, &reg_resp); !s.ok()) return fail("Register", s);
  w.id = reg_resp.worker_id();
  dynamiq::v1::AllocateBufferRequest alloc;
  alloc.set_worker_id(w.id);
  alloc.set_bytes(floats * 4);
  dynamiq::v1::AllocateBufferResponse alloc_resp;
  grpc::ClientContext c2;
  if (grpc::Status s = w.stub->AllocateBuffer(&c2, alloc, &alloc_resp); !s.ok()) return fail("AllocateBuffer", s);
  w.buffer_id = alloc_resp.buffer_id();
  auto region = ipc::ShmRegion::Open(alloc_resp.shm_name(), floats * 4);
  if (!region.ok()) return region.status();
  w.region = std::make_unique<ipc::ShmRegion>(std::move(region).value());
  dynamiq::v1::MappedRequest mapped;
  mapped.set_worker_id(w.id);
  mapped.set_buffer_id(w.buffer_id);
  dynamiq::v1::MappedResponse mapped_resp;
  grpc::ClientContext c3;
  if (grpc::Status s = w.stub->Mapped(&c3, mapped, &mapped_resp); !s.ok()) return fail("Mapped", s);
  return w;
}

// Connects `local` workers of job "job" (local ranks 0..local-1 of `local`) to each of the `nodes`
// daemons StartTestCluster started in `dir`, each mapping `floats` floats: worker node * local + rank.
inline absl::StatusOr<std::vector<DaemonTestWorker>> ConnectTestWorkers(const std::string& dir, uint32_t nodes,
                                                                        uint32_t local, size_t floats) {
  std::vector<DaemonTestWorker> workers;
  for (uint32_t node = 0; node < nodes; ++node) {
    for (uint32_t rank = 0; rank < local; ++rank) {
      absl::StatusOr<DaemonTestWorker> w =
          ConnectTestWorker(absl::StrCat(dir, "/node", node, ".sock"), "job", rank, local, floats);
      if (!w.ok()) {
        return absl::Status(w.status().code(),
                            absl::StrCat("node ", node, " local rank ", rank, ": ", w.status().message()));
      }
      workers.push_back(*std::move(w));
    }
  }
  return workers;
}

// Every worker all-reduces its buffer's first `n` floats as tensor `name` at once, each on its own
// thread (a collective needs all of them); returns each worker's status, and its response in
// `responses` when given (one per worker).
inline std::vector<grpc::Status> AllReduceTogether(std::vector<DaemonTestWorker>& workers, const std::string& name,
                                                   size_t n,
                                                   std::vector<dynamiq::v1::AllReduceResponse>* responses = nullptr) {
  std::vector<grpc::Status> status(workers.size());
  if (responses != nullptr) responses->assign(workers.size(), {});
  std::vector<std::thread> threads;
  for (size_t w = 0; w < workers.size(); ++w) {
    threads.emplace_back([&, w] {
      status[w] = workers[w].AllReduce(name, n, false, responses != nullptr ? &(*responses)[w] : nullptr);
    });
  }
  for (auto& t : threads) t.join();
  return status;
}

// dynamiq_rejected_requests_total{reason=`reason`} of `daemon` (-1 when the series is missing).
inline double RejectedRequests(server::Daemon& daemon, const std::string& reason) {
  for (absl::string_view line : absl::StrSplit(daemon.metrics().Render(), '\n')) {
    if (!absl::StartsWith(line, "dynamiq_rejected_requests_total{") ||
        !absl::StrContains(line, absl::StrCat("reason=\"", reason, "\""))) {
      continue;
    }
    double value = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) return value;
  }
  return -1;
}

// Daemon options for node `rank` of `nodes` on loopback (port 0, socket <dir>/node<rank>.sock).
inline server::DaemonOptions TestDaemonOptions(const std::string& dir, uint32_t rank, uint32_t nodes,
                                               const server::JobConfig& config) {
  server::DaemonOptions o;
  o.node_rank = rank;
  o.num_nodes = nodes;
  o.listen = "127.0.0.1:0";
  o.worker_socket = absl::StrCat(dir, "/node", rank, ".sock");
  o.default_config = config;
  o.timeout = absl::Seconds(20);
  return o;
}

// Starts `nodes` daemons that form one cluster (node 0 coordinates), with --timeout `timeout`.
// Start() returns only once every node has joined, so the nodes start on their own threads.
// `customize` (optional) adjusts every node's options before it starts (e.g. --device).
inline absl::StatusOr<std::vector<std::unique_ptr<server::Daemon>>> StartTestCluster(
    const std::string& dir, uint32_t nodes, const server::JobConfig& config, absl::Duration timeout = absl::Seconds(20),
    const std::function<void(server::DaemonOptions&)>& customize = nullptr) {
  std::vector<std::unique_ptr<server::Daemon>> daemons;
  server::DaemonOptions first = TestDaemonOptions(dir, 0, nodes, config);
  first.timeout = timeout;
  if (customize) customize(first);
  daemons.push_back(std::make_unique<server::Daemon>(first));
  std::vector<absl::Status> status(nodes);
  std::vector<std::thread> threads;
  threads.emplace_back([&] { status[0] = daemons[0]->Start(); });
  for (int i = 0; i < 1000 && daemons[0]->listen_address().empty(); ++i) absl::SleepFor(absl::Milliseconds(10));
  const std::string coordinator = daemons[0]->listen_address();
  for (uint32_t r = 1; r < nodes; ++r) {
    server::DaemonOptions o = TestDaemonOptions(dir, r, nodes, config);
    o.coordinator = coordinator;
    o.timeout = timeout;
    if (customize) customize(o);
    daemons.push_back(std::make_unique<server::Daemon>(o));
  }
  for (uint32_t r = 1; r < nodes; ++r) {
    threads.emplace_back([&, r] {
      status[r] = daemons[r]->Start();
      // A node refused as it joins (its settings differ from node 0's) leaves the others waiting
      // for it: stop them, and report the refusal rather than their cancelled starts.
      if (!status[r].ok()) {
        for (auto& d : daemons) d->CancelStart();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok() && !absl::IsCancelled(s)) return s;
  }
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return daemons;
}

}  // namespace dynamiq::testing

#endif  // DQ_TESTS_TESTING_DAEMON_HARNESS_H_
