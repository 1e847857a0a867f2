// DeviceBufferRegistry's bookkeeping (ids, regions, limits, release) over a host-memory
// DeviceMemory, so it runs without a GPU. The CUDA DeviceMemory is exercised by the GPU tests in
// daemon_device_test.cc.
#include "ipc/device_buffers.h"

#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::ipc {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::SizeIs;

// Host memory standing in for a device; records what is live.
struct FakeState {
  absl::Mutex mu;
  std::set<void*> live;
  int allocations = 0;
  bool fail_next = false;
};

class FakeDeviceMemory final : public DeviceMemory {
 public:
  explicit FakeDeviceMemory(std::shared_ptr<FakeState> state) : state_(std::move(state)) {}
  absl::StatusOr<Allocation> Allocate(size_t bytes) override {
    absl::MutexLock lock(&state_->mu);
    if (state_->fail_next) {
      state_->fail_next = false;
      return absl::ResourceExhaustedError("out of memory");
    }
    void* data = std::calloc(bytes, 1);
    state_->live.insert(data);
    ++state_->allocations;
    return Allocation{data, std::string(64, static_cast<char>('a' + state_->allocations % 26))};
  }
  void Free(void* data) override {
    absl::MutexLock lock(&state_->mu);
    EXPECT_EQ(state_->live.erase(data), 1u) << "freed twice or never allocated";
    std::free(data);
  }
  int device() const override { return 3; }
  std::string uuid() const override { return std::string(16, 'u'); }

 private:
  std::shared_ptr<FakeState> state_;
};

size_t Live(FakeState& state) {
  absl::MutexLock lock(&state.mu);
  return state.live.size();
}

TEST(DeviceBufferRegistryTest, AllocateHandsOutAHandleTheDeviceAndIdsAboveTheSharedMemoryRange) {
  auto state = std::make_shared<FakeState>();
  DeviceBufferRegistry registry(std::make_unique<FakeDeviceMemory>(state), {});
  auto a = registry.Allocate(7, 1000);
  auto b = registry.Allocate(7, 2000);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_TRUE(IsDeviceBufferId(a->buffer_id));
  EXPECT_FALSE(IsDeviceBufferId(1));
  EXPECT_NE(a->buffer_id, b->buffer_id);
  EXPECT_EQ(a->size, 1000u);
  EXPECT_THAT(a->ipc_handle, SizeIs(64));
  EXPECT_EQ(a->device, 3);
  EXPECT_EQ(a->device_uuid, std::string(16, 'u'));
  EXPECT_EQ(registry.TotalBytes(), 3000u);
  EXPECT_EQ(registry.NumBuffers(), 2u);
  EXPECT_EQ(Live(*state), 2u);
}

TEST(DeviceBufferRegistryTest, UseResolvesRegionsOfTheWorkersOwnBuffersOnly) {
  auto state = std::make_shared<FakeState>();
  DeviceBufferRegistry registry(std::make_unique<FakeDeviceMemory>(state), {});
  auto a = registry.Allocate(7, 1024);
  ASSERT_THAT(a, IsOk());
  auto region = registry.Use(7, a->buffer_id, 512, 512);
  ASSERT_THAT(region, IsOk());
  auto whole = registry.Use(7, a->buffer_id, 0, 1024);
  ASSERT_THAT(whole, IsOk());
  EXPECT_EQ(region->region.data(), whole->region.data() + 512);
  EXPECT_EQ(region->region.size(), 512u);
  EXPECT_THAT(registry.Use(7, a->buffer_id, 512, 513), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(registry.Use(7, a->buffer_id, ~size_t{0}, 2), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_THAT(registry.Use(8, a->buffer_id, 0, 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not allocated to worker 8")));
  EXPECT_THAT(registry.Use(7, a->buffer_id + 1, 0, 1), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(registry.Find(7, a->buffer_id), IsOk());
  EXPECT_THAT(registry.Find(8, a->buffer_id), StatusIs(absl::StatusCode::kNotFound));
}

// Use and release are one admission: a buffer in use is never freed under its user.
TEST(DeviceBufferRegistryTest, ABufferInUseIsNotReleasedAndAReleasedWorkersBufferLivesUntilItsUseEnds) {
  auto state = std::make_shared<FakeState>();
  DeviceBufferRegistry registry(std::make_unique<FakeDeviceMemory>(state), {});
  auto a = registry.Allocate(7, 1024);
  auto b = registry.Allocate(7, 2048);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  {
    absl::StatusOr<BufferUse> use = registry.Use(7, a->buffer_id, 0, 1024);
    ASSERT_THAT(use, IsOk());
    BufferUse copy = *use;  // a copy holds the use too
    use = absl::CancelledError("");
    EXPECT_THAT(registry.Release(7, a->buffer_id),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("has not completed")));
    EXPECT_EQ(Live(*state), 2u);
  }
  DQ_EXPECT_OK(registry.Release(7, a->buffer_id));
  EXPECT_EQ(Live(*state), 1u);

  absl::StatusOr<BufferUse> use = registry.Use(7, b->buffer_id, 0, 16);
  ASSERT_THAT(use, IsOk());
  EXPECT_EQ(registry.ReleaseWorker(7), 1u);
  // Out of the table at once (a new use is NOT_FOUND), but still allocated and counted.
  EXPECT_THAT(registry.Use(7, b->buffer_id, 0, 16), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(registry.Release(7, b->buffer_id), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(Live(*state), 1u);
  EXPECT_EQ(registry.TotalBytes(), 2048u);
  EXPECT_EQ(registry.NumBuffers(), 1u);
  use = absl::CancelledError("");  // the last use ends: now it is freed
  EXPECT_EQ(Live(*state), 0u);
  EXPECT_EQ(registry.TotalBytes(), 0u);
  EXPECT_EQ(registry.NumBuffers(), 0u);
}

TEST(DeviceBufferRegistryTest, BadSizesAndLimitsAreRefusedWithoutChangingAnything) {
  auto state = std::make_shared<FakeState>();
  DeviceBufferRegistry::Options limits;
  limits.max_bytes_per_worker = 3000;
  limits.max_total_bytes = 5000;
  limits.max_buffers_per_worker = 2;
  DeviceBufferRegistry registry(std::make_unique<FakeDeviceMemory>(state), limits);
  EXPECT_THAT(registry.Allocate(1, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0-byte")));
  EXPECT_THAT(registry.Allocate(1, kMaxDeviceBufferBytes + 1), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(registry.Allocate(1, 2000), IsOk());
  EXPECT_THAT(registry.Allocate(1, 1001),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("of its 3000-byte limit")));
  ASSERT_THAT(registry.Allocate(1, 1000), IsOk());
  EXPECT_THAT(registry.Allocate(1, 1), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("2 device buffers")));
  ASSERT_THAT(registry.Allocate(2, 1500), IsOk());
  EXPECT_THAT(registry.Allocate(2, 501), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("daemon's")));
  EXPECT_EQ(registry.TotalBytes(), 4500u);
  EXPECT_EQ(Live(*state), 3u);
}

TEST(DeviceBufferRegistryTest, DeviceOutOfMemoryKeepsItsCodeAndNamesTheRequest) {
  auto state = std::make_shared<FakeState>();
  DeviceBufferRegistry registry(std::make_unique<FakeDeviceMemory>(state), {});
  state->fail_next = true;
  EXPECT_THAT(registry.Allocate(4, 4096),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("4096 bytes for worker 4")));
  EXPECT_EQ(registry.TotalBytes(), 0u);
  EXPECT_THAT(registry.Allocate(4, 4096), IsOk());  // nothing stuck from the failed one
}

TEST(DeviceBufferRegistryTest, ReleaseFreesOneBufferAndStaleIdsAreNotFound) {
  auto state = std::make_shared<FakeState>();
  DeviceBufferRegistry registry(std::make_unique<FakeDeviceMemory>(state), {});
  auto a = registry.Allocate(7, 100);
  auto b = registry.Allocate(7, 200);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_THAT(registry.Release(8, a->buffer_id), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(registry.Release(7, a->buffer_id), IsOk());
  EXPECT_THAT(registry.Release(7, a->buffer_id), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(registry.Use(7, a->buffer_id, 0, 1), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(registry.TotalBytes(), 200u);
  EXPECT_EQ(Live(*state), 1u);
  auto c = registry.Allocate(7, 100);
  ASSERT_THAT(c, IsOk());
  EXPECT_NE(c->buffer_id, a->buffer_id);  // ids are never reused
}

TEST(DeviceBufferRegistryTest, ReleaseWorkerAndDestructionFreeEverything) {
  auto state = std::make_shared<FakeState>();
  {
    DeviceBufferRegistry registry(std::make_unique<FakeDeviceMemory>(state), {});
    ASSERT_THAT(registry.Allocate(1, 100), IsOk());
    ASSERT_THAT(registry.Allocate(1, 100), IsOk());
    ASSERT_THAT(registry.Allocate(2, 100), IsOk());
    EXPECT_EQ(registry.ReleaseWorker(1), 2u);
    EXPECT_EQ(registry.ReleaseWorker(1), 0u);
    EXPECT_EQ(registry.NumBuffers(), 1u);
    EXPECT_EQ(registry.TotalBytes(), 100u);
    EXPECT_EQ(Live(*state), 1u);
  }
  EXPECT_EQ(Live(*state), 0u);
}

}  // namespace
}  // namespace dynamiq::ipc
