// A worker process for the GPU tests (tests/server/daemon_device_test.cc): registers with the
// dynamiqd at --socket as local rank --rank of --size of job "device-job", allocates a buffer
// (--memory=device: a CUDA device buffer, MemoryKind::kCudaDevice; host: shared memory), and
// all-reduces it in place --rounds times, each time filled with contributor --global's values of
// that round.
//
// Without --out: every round must equal the exact sum over --contributors contributors (round 1
// averaged); exit code 0 when every value matched, 1 with a message otherwise.
// With --out=PREFIX (a stepwise run driven by the test, for compressed codecs and compression
// changes): before every round but the first it reads one line from stdin (the test's "go"); after
// each round it writes the result to PREFIX.round<r> (raw fp32) and prints "done <r>" to stdout.
// The round --average_round is averaged. --reallocate: a new buffer every round.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "dynamiq/client.h"

ABSL_FLAG(std::string, socket, "", "The dynamiqd worker socket.");
ABSL_FLAG(int, rank, 0, "Local rank.");
ABSL_FLAG(int, size, 1, "Local world size.");
ABSL_FLAG(int, global, 0, "This worker's contributor index (its values).");
ABSL_FLAG(int, contributors, 1, "Workers of the job in all nodes (for the exact sums).");
ABSL_FLAG(int64_t, n, 1, "Elements of the buffer.");
ABSL_FLAG(std::string, memory, "device", "Buffer memory: device (needs a --device=cuda daemon) or host.");
ABSL_FLAG(int, rounds, 2, "All-reduces to run.");
ABSL_FLAG(std::string, out, "", "Stepwise mode: write each round's result to OUT.round<r> (see the file comment).");
ABSL_FLAG(int, average_round, 1, "The round that is averaged (-1: none).");
ABSL_FLAG(bool, reallocate, false,
          "Allocate a new buffer for every round and release it after (as dynamiq.torch.all_reduce with a client "
          "does).");

namespace {

// Contributor c's value at element i in round r; sums of these are exact in fp32 for small counts.
float Value(int c, size_t i, int r) {
  return 0.5f * static_cast<float>(c + 1) + static_cast<float>((i + static_cast<size_t>(r)) % 7) - 3.0f;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "dq-device-worker: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const size_t n = static_cast<size_t>(absl::GetFlag(FLAGS_n));
  const int global = absl::GetFlag(FLAGS_global), contributors = absl::GetFlag(FLAGS_contributors);
  const std::string out = absl::GetFlag(FLAGS_out);
  const bool device = absl::GetFlag(FLAGS_memory) == "device";
  if (!device && absl::GetFlag(FLAGS_memory) != "host") return Fail("--memory is device or host");
  dynamiq::ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.job_id = "device-job";
  options.local_rank = static_cast<uint32_t>(absl::GetFlag(FLAGS_rank));
  options.local_world_size = static_cast<uint32_t>(absl::GetFlag(FLAGS_size));
  options.timeout = absl::Seconds(120);
  absl::StatusOr<dynamiq::Client> client = dynamiq::Client::Connect(options);
  if (!client.ok()) return Fail(client.status().ToString());
  if (device && client->daemon_device() != dynamiq::DeviceKind::kCuda) {
    return Fail("--memory=device: the daemon does not run --device=cuda");
  }
  absl::StatusOr<dynamiq::Buffer> buffer =
      client->Allocate(n * sizeof(float), device ? dynamiq::MemoryKind::kCudaDevice : dynamiq::MemoryKind::kHost);
  if (!buffer.ok()) return Fail(buffer.status().ToString());
  if (device) {
    if (buffer->device_data() == nullptr || buffer->data() != nullptr) return Fail("not a device buffer");
    if (cudaSetDevice(buffer->device()) != cudaSuccess) return Fail("cudaSetDevice failed");
  } else if (buffer->data() == nullptr) {
    return Fail("not a host buffer");
  }

  std::vector<float> host(n);
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    if (!out.empty() && round > 0) {
      std::string go;
      if (!std::getline(std::cin, go)) return Fail("stdin closed before round " + std::to_string(round));
    }
    const bool average = round == absl::GetFlag(FLAGS_average_round);
    for (size_t i = 0; i < n; ++i) host[i] = Value(global, i, round);
    // Synchronous copies: the buffer holds the values before the daemon reads it.
    if (device) {
      if (cudaMemcpy(buffer->device_data(), host.data(), n * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) {
        return Fail("cudaMemcpy to the device buffer failed");
      }
    } else {
      std::copy(host.begin(), host.end(), static_cast<float*>(buffer->data()));
    }
    absl::Status s = client->AllReduce(*buffer, 0, n, dynamiq::DType::kFloat32, "grad", average);
    if (!s.ok()) return Fail(s.ToString());
    if (device) {
      if (cudaMemcpy(host.data(), buffer->device_data(), n * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
        return Fail("cudaMemcpy from the device buffer failed");
      }
    } else {
      const float* data = static_cast<const float*>(buffer->data());
      host.assign(data, data + n);
    }
    if (!out.empty()) {
      const std::string path = absl::StrCat(out, ".round", round);
      FILE* f = std::fopen(path.c_str(), "wb");
      if (f == nullptr || std::fwrite(host.data(), sizeof(float), n, f) != n || std::fclose(f) != 0) {
        return Fail("cannot write " + path);
      }
      std::cout << "done " << round << std::endl;
      continue;
    }
    for (size_t i = 0; i < n; ++i) {
      float sum = 0;
      for (int c = 0; c < contributors; ++c) sum += Value(c, i, round);
      const float expected = average ? sum * (1.0f / static_cast<float>(contributors)) : sum;
      if (host[i] != expected) {
        return Fail("round " + std::to_string(round) + ": element " + std::to_string(i) + " is " +
                    std::to_string(host[i]) + ", expected " + std::to_string(expected));
      }
    }
  }
  absl::Status released = buffer->Release();
  if (!released.ok()) return Fail(released.ToString());
  return 0;
}
