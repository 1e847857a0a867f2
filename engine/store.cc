#include "engine/store.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace dynamiq::engine {

absl::Status InMemoryStore::Put(absl::string_view key, absl::string_view value) {
  auto it = values_.find(key);
  const size_t old_bytes = it == values_.end() ? 0 : key.size() + it->second.size();
  const size_t new_bytes = key.size() + value.size();
  if (it == values_.end() && values_.size() >= limits_.max_keys) {
    return absl::ResourceExhaustedError(absl::StrCat("the store holds ", values_.size(),
                                                     " keys, the most it keeps; cannot add '",
                                                     absl::CHexEscape(key.substr(0, 128)), "'"));
  }
  if (new_bytes > old_bytes && bytes_ - old_bytes + new_bytes > limits_.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the store holds ", bytes_, " bytes of keys and values, ",
                                                     new_bytes, " more would exceed its limit of ", limits_.max_bytes));
  }
  bytes_ = bytes_ - old_bytes + new_bytes;
  if (it == values_.end()) {
    values_.emplace(std::string(key), std::string(value));
  } else {
    it->second.assign(value.data(), value.size());
  }
  return absl::OkStatus();
}

absl::Status InMemoryStore::Set(absl::string_view key, absl::string_view value) {
  absl::MutexLock lock(&mu_);
  return Put(key, value);
}

absl::StatusOr<uint64_t> InMemoryStore::Delete(const Deletion& deletion) {
  absl::MutexLock lock(&mu_);
  uint64_t deleted = 0;
  auto erase = [&](auto it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bytes_ -= it->first.size() + it->second.size();
    ++deleted;
    return values_.erase(it);
  };
  for (const std::string& key : deletion.keys) {
    if (auto it = values_.find(key); it != values_.end()) erase(it);
  }
  auto starts = [&](absl::string_view prefix) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = values_.lower_bound(prefix);
    return it != values_.end() && absl::StartsWith(it->first, prefix) ? it : values_.end();
  };
  if (deletion.prefix.empty()) return deleted;
  if (!deletion.unless_prefix.empty() && starts(deletion.unless_prefix) != values_.end()) return deleted;
  for (auto it = starts(deletion.prefix); it != values_.end() && absl::StartsWith(it->first, deletion.prefix);) {
    it = erase(it);
  }
  return deleted;
}

size_t InMemoryStore::size() const {
  absl::MutexLock lock(&mu_);
  return values_.size();
}

size_t InMemoryStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

absl::StatusOr<bool> InMemoryStore::CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                                  absl::string_view desired) {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  const bool matches = it == values_.end() ? !expected.has_value() : expected.has_value() && it->second == *expected;
  if (!matches) return false;
  DQ_RETURN_IF_ERROR(Put(key, desired));
  return true;
}

absl::StatusOr<std::vector<std::optional<std::string>>> Store::GetMany(absl::Span<const std::string> keys) {
  std::vector<std::optional<std::string>> values;
  values.reserve(keys.size());
  for (const std::string& key : keys) {
    absl::StatusOr<std::string> value = Get(key, absl::ZeroDuration());
    if (IsKeyNotSet(value.status())) {
      values.emplace_back(std::nullopt);
    } else if (!value.ok()) {
      return value.status();
    } else {
      values.emplace_back(*std::move(value));
    }
  }
  return values;
}

bool IsKeyNotSet(const absl::Status& status) {
  return absl::IsDeadlineExceeded(status) && absl::StrContains(status.message(), "was not set within");
}

absl::StatusOr<std::string> InMemoryStore::Get(absl::string_view key, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return values_.find(key) != values_.end(); };
  // Not Await for a key that is there or a look that may not wait: an already-expired wait still
  // sleeps the kernel's timer slack (about 50 us), which a one-node daemon paid twice per
  // collective reading its configuration.
  if (!present() && (timeout <= absl::ZeroDuration() || !mu_.AwaitWithTimeout(absl::Condition(&present), timeout))) {
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
  if (!all() && (timeout <= absl::ZeroDuration() || !mu_.AwaitWithTimeout(absl::Condition(&all), timeout))) {
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

absl::StatusOr<uint64_t> PrefixStore::Delete(const Deletion& deletion) {
  Deletion prefixed;
  for (const std::string& k : deletion.keys) prefixed.keys.push_back(Key(k));
  if (!deletion.prefix.empty()) prefixed.prefix = Key(deletion.prefix);
  if (!deletion.unless_prefix.empty()) prefixed.unless_prefix = Key(deletion.unless_prefix);
  return base_.Delete(prefixed);
}

absl::StatusOr<std::string> PrefixStore::Get(absl::string_view key, absl::Duration timeout) {
  return base_.Get(Key(key), timeout);
}

absl::StatusOr<std::vector<std::optional<std::string>>> PrefixStore::GetMany(absl::Span<const std::string> keys) {
  std::vector<std::string> prefixed;
  prefixed.reserve(keys.size());
  for (const std::string& key : keys) prefixed.push_back(Key(key));
  return base_.GetMany(prefixed);
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
