// Future: the completion of an asynchronous all-reduce (Client::AllReduceAsync).
// Include <dynamiq/client.h> rather than this header.
//
// Thread-safety: Wait() and Ready() may be called concurrently from any threads; moves and
// destruction need exclusive access.
#ifndef DQ_CLIENT_INCLUDE_DYNAMIQ_FUTURE_H_
#define DQ_CLIENT_INCLUDE_DYNAMIQ_FUTURE_H_

#include <memory>

#include "absl/status/status.h"
#include "dynamiq/options.h"

namespace dynamiq {

class Client;
namespace client::internal {
class FutureState;
}  // namespace client::internal

/// The pending result of one asynchronous all-reduce. Move-only.
///
/// Destroying a Future does not cancel the all-reduce: it still completes (or times out) and its
/// result lands in the buffer; only the status is lost.
class Future {
 public:
  /// An invalid future: Ready() is true and Wait() returns FAILED_PRECONDITION. Moved-from futures
  /// are invalid too.
  Future();
  Future(Future&& other) noexcept;
  Future& operator=(Future&& other) noexcept;
  Future(const Future&) = delete;
  Future& operator=(const Future&) = delete;
  ~Future();

  /// Blocks until the all-reduce completed and returns its status: OK once the result is in the
  /// buffer, otherwise the daemon's error (same code and message) or a client-side one. Every
  /// all-reduce has a deadline (ClientOptions::timeout), so Wait() returns. May be called again; it
  /// returns the same status.
  absl::Status Wait() const;

  /// True once Wait() would return without blocking.
  bool Ready() const;

  /// What the daemon reported about the collective. Call only after Wait() returned OK (otherwise
  /// every field is zero or empty). The reference lives as long as the Future.
  const AllReduceResult& result() const;

  /// False for a default-constructed or moved-from future.
  bool valid() const { return state_ != nullptr; }

 private:
  friend class Client;
  explicit Future(std::shared_ptr<client::internal::FutureState> state);

  std::shared_ptr<client::internal::FutureState> state_;
};

}  // namespace dynamiq

#endif  // DQ_CLIENT_INCLUDE_DYNAMIQ_FUTURE_H_
