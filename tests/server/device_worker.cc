// A worker process for the GPU tests (tests/server/daemon_device_test.cc): registers with the
// dynamiqd at SOCKET as local rank RANK of SIZE of job "device-job", allocates a CUDA device
// buffer (MemoryKind::kCudaDevice), fills it with contributor GLOBAL's values, all-reduces it in
// place (fp32, then averaged) and checks the results against the exact sums over CONTRIBUTORS
// contributors. Exit code 0 when every value matched; 1 with a message otherwise.
//
// Usage: dq-device-worker SOCKET RANK SIZE GLOBAL CONTRIBUTORS N
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "dynamiq/client.h"

namespace {

// Contributor c's value at element i; sums of these are exact in fp32 for small counts.
float Value(int c, size_t i) { return 0.5f * static_cast<float>(c + 1) + static_cast<float>(i % 7); }

int Fail(const std::string& message) {
  std::fprintf(stderr, "dq-device-worker: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  int rank, size, global, contributors;
  size_t n;
  if (argc != 7 || !absl::SimpleAtoi(argv[2], &rank) || !absl::SimpleAtoi(argv[3], &size) ||
      !absl::SimpleAtoi(argv[4], &global) || !absl::SimpleAtoi(argv[5], &contributors) ||
      !absl::SimpleAtoi(argv[6], &n)) {
    return Fail("usage: dq-device-worker SOCKET RANK SIZE GLOBAL CONTRIBUTORS N");
  }
  dynamiq::ClientOptions options;
  options.socket_path = argv[1];
  options.job_id = "device-job";
  options.local_rank = static_cast<uint32_t>(rank);
  options.local_world_size = static_cast<uint32_t>(size);
  options.timeout = absl::Seconds(120);
  absl::StatusOr<dynamiq::Client> client = dynamiq::Client::Connect(options);
  if (!client.ok()) return Fail(client.status().ToString());
  if (client->daemon_device() != dynamiq::DeviceKind::kCuda) return Fail("the daemon does not run --device=cuda");
  absl::StatusOr<dynamiq::Buffer> buffer = client->Allocate(n * sizeof(float), dynamiq::MemoryKind::kCudaDevice);
  if (!buffer.ok()) return Fail(buffer.status().ToString());
  if (buffer->device_data() == nullptr || buffer->data() != nullptr) return Fail("not a device buffer");
  if (cudaSetDevice(buffer->device()) != cudaSuccess) return Fail("cudaSetDevice failed");

  std::vector<float> host(n);
  for (int round = 0; round < 2; ++round) {
    const bool average = round == 1;
    for (size_t i = 0; i < n; ++i) host[i] = Value(global, i);
    // Synchronous copies: the buffer holds the values before the daemon reads it.
    if (cudaMemcpy(buffer->device_data(), host.data(), n * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) {
      return Fail("cudaMemcpy to the device buffer failed");
    }
    absl::Status s = client->AllReduce(*buffer, 0, n, dynamiq::DType::kFloat32, "grad", average);
    if (!s.ok()) return Fail(s.ToString());
    if (cudaMemcpy(host.data(), buffer->device_data(), n * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
      return Fail("cudaMemcpy from the device buffer failed");
    }
    for (size_t i = 0; i < n; ++i) {
      float sum = 0;
      for (int c = 0; c < contributors; ++c) sum += Value(c, i);
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
