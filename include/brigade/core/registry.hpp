// brigade::Registry: a name -> entry table with built-in entries and entries users add at run
// time. The schedule generators (schedule/registry.hpp) and the partition policies
// (partition/policies.hpp) are two instances.
#pragma once

#include "brigade/core/error.hpp"

#include <cstddef>
#include <deque>
#include <initializer_list>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace brigade {
inline namespace v0 {

/// A table of `Info` entries looked up by name: the built-in entries first, then those added
/// with add() in order. `Info` has `std::string_view name` and `std::string_view summary`
/// members; add() copies both strings, so the caller's need not outlive the call.
///
/// Capacity is reserved once (`kCapacity` entries), so spans and references handed out stay
/// valid when entries are added. add() locks; lookups do not, so register before lookups run on
/// other threads (the usual "register at start-up" rule of plugin tables).
template <class Info>
class Registry {
 public:
  static constexpr std::size_t kCapacity = 256;  ///< entries at most, built-in ones included

  /// @param what   what an entry is, for error messages ("schedule", "partition policy")
  /// @param builtin the built-in entries (their strings must have static storage)
  Registry(std::string_view what, std::initializer_list<Info> builtin) : what_(what) {
    entries_.reserve(kCapacity);
    entries_.assign(builtin);
  }

  /// Every entry, built-in ones first.
  [[nodiscard]] std::span<const Info> entries() const noexcept { return entries_; }

  /// Adds `info` (name and summary copied).
  /// @param valid whether the entry's other fields are usable (e.g. its function is non-null)
  /// @throws brigade::Error{InvalidArgument} for an empty name, !valid, a name already taken,
  ///         or a full table
  void add(const Info& info, bool valid) {
    const std::lock_guard lock(mutex_);
    BRIGADE_CHECK(!info.name.empty() && valid, Errc::InvalidArgument,
                  "register: a {} needs a name and a function (name '{}')", what_,
                  ::brigade::detail::excerpt(info.name));
    for (const auto& e : entries_)
      BRIGADE_CHECK(e.name != info.name, Errc::InvalidArgument,
                    "register: a {} called '{}' exists already", what_,
                    ::brigade::detail::excerpt(info.name));
    BRIGADE_CHECK(entries_.size() < kCapacity, Errc::InvalidArgument,
                  "register: the {} table holds {} entries already (the limit)", what_,
                  entries_.size());
    Info copy = info;
    copy.name = text_.emplace_back(info.name);
    copy.summary = text_.emplace_back(info.summary);
    entries_.push_back(copy);
  }

  /// The entry called `name`.
  /// @throws brigade::Error{InvalidArgument} "unknown <what> '<name>', expected one of: ..."
  [[nodiscard]] const Info& find(std::string_view name) const {
    for (const auto& e : entries_)
      if (e.name == name) return e;
    ::brigade::detail::fail(Errc::InvalidArgument, "unknown {} '{}', expected one of: {}", what_,
                            ::brigade::detail::excerpt(name), names());
  }

  /// The names, comma-separated, in table order.
  [[nodiscard]] std::string names() const {
    std::string known;
    for (const auto& e : entries_) {
      if (!known.empty()) known += ", ";
      known += e.name;
    }
    return known;
  }

 private:
  std::string_view what_;
  std::vector<Info> entries_;
  std::deque<std::string> text_;  // owned names and summaries of added entries
  std::mutex mutex_;
};

}  // namespace v0
}  // namespace brigade
