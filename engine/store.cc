#include "engine/store.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dynamiq::engine {

absl::Status InMemoryStore::Set(absl::string_view key, absl::string_view value) {
  absl::MutexLock lock(&mu_);
  values_[std::string(key)] = std::string(value);
  return absl::OkStatus();
}

absl::StatusOr<bool> InMemoryStore::CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                                  absl::string_view desired) {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  const bool matches = it == values_.end() ? !expected.has_value() : expected.has_value() && it->second == *expected;
  if (!matches) return false;
  values_[std::string(key)] = std::string(desired);
  return true;
}

bool IsKeyNotSet(const absl::Status& status) {
  return absl::IsDeadlineExceeded(status) && absl::StrContains(status.message(), "was not set within");
}

absl::StatusOr<std::string> InMemoryStore::Get(absl::string_view key, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return values_.find(key) != values_.end(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat("store key '", key, "' was not set within ", absl::FormatDuration(timeout)));
  }
  return values_.find(key)->second;
}

absl::Status InMemoryStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& k : keys) {
      if (values_.find(k) == values_.end()) return false;
    }
    return true;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&all), timeout)) {
    std::vector<std::string> missing;
    for (const std::string& k : keys) {
      if (values_.find(k) == values_.end()) missing.push_back(k);
    }
    return absl::DeadlineExceededError(
        absl::StrCat("store keys not set within ", absl::FormatDuration(timeout), ": ", absl::StrJoin(missing, ", ")));
  }
  return absl::OkStatus();
}

std::string PrefixStore::Key(absl::string_view key) const { return absl::StrCat(prefix_, "/", key); }

absl::Status PrefixStore::Set(absl::string_view key, absl::string_view value) { return base_.Set(Key(key), value); }

absl::StatusOr<bool> PrefixStore::CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                                absl::string_view desired) {
  return base_.CompareAndSet(Key(key), expected, desired);
}

absl::StatusOr<std::string> PrefixStore::Get(absl::string_view key, absl::Duration timeout) {
  return base_.Get(Key(key), timeout);
}

absl::Status PrefixStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  std::vector<std::string> prefixed;
  for (const std::string& k : keys) prefixed.push_back(Key(k));
  return base_.Wait(prefixed, timeout);
}

absl::StatusOr<std::string> InterruptibleStore::Get(absl::string_view key, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<std::string> value =
        base_.Get(key, std::min(poll_, std::max(absl::ZeroDuration(), deadline - absl::Now())));
    if (value.ok() || !absl::IsDeadlineExceeded(value.status()) || absl::Now() >= deadline) return value;
    if (absl::Status stop = interrupted_(); !stop.ok()) return stop;
  }
}

absl::Status InterruptibleStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::Status s = base_.Wait(keys, std::min(poll_, std::max(absl::ZeroDuration(), deadline - absl::Now())));
    if (s.ok() || !absl::IsDeadlineExceeded(s) || absl::Now() >= deadline) return s;
    if (absl::Status stop = interrupted_(); !stop.ok()) return stop;
  }
}

}  // namespace dynamiq::engine
