#include "dynamiq/future.h"

#include <utility>

#include "client/connection.h"

namespace dynamiq {

Future::Future() = default;
Future::Future(std::shared_ptr<client::internal::FutureState> state) : state_(std::move(state)) {}
Future::Future(Future&& other) noexcept = default;
Future& Future::operator=(Future&& other) noexcept = default;
Future::~Future() = default;

absl::Status Future::Wait() const {
  if (state_ == nullptr) return absl::FailedPreconditionError("Wait on an invalid dynamiq::Future (moved from?)");
  return state_->Wait();
}

bool Future::Ready() const { return state_ == nullptr || state_->Ready(); }

const AllReduceResult& Future::result() const {
  static const AllReduceResult* const kEmpty = new AllReduceResult();
  return state_ == nullptr ? *kEmpty : state_->result();
}

}  // namespace dynamiq
