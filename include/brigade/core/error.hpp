// brigade::Error: the one exception type every brigade function throws for bad input.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace brigade {
inline namespace v0 {

/// What kind of failure an Error reports. Stable: tests and callers switch on it.
enum class Errc : int {
  InvalidArgument,  ///< a value outside its documented range (a flag, a shape, a config field)
  InvalidUsage,     ///< a call made in the wrong state (wait on a consumed request, ...)
  BadFile,          ///< a file that is missing, truncated, or whose contents contradict its header
  Deadlock,         ///< a schedule that cannot complete; the message names the wait-for cycle
  HeaderMismatch,   ///< a received message whose header differs from the one expected
  PeerTimeout,      ///< a peer that did not answer before the deadline; the message names it
  Aborted,          ///< a transport closed because another rank failed
  Cuda,             ///< a CUDA runtime or cuBLAS call failed
  Nccl,             ///< an NCCL call failed
  Mpi,              ///< an MPI call failed
  Internal,         ///< a broken invariant inside brigade (a bug: please report it)
  NonFinite,        ///< a NaN or infinity in weights, activations, logits, a loss or a gradient
  Rejected,         ///< a received message an inspection hook refused (transport::InspectingTransport)
};

/// Name of an error code, e.g. "BadFile".
constexpr std::string_view to_string(Errc c) noexcept {
  switch (c) {
    case Errc::InvalidArgument: return "InvalidArgument";
    case Errc::InvalidUsage: return "InvalidUsage";
    case Errc::BadFile: return "BadFile";
    case Errc::Deadlock: return "Deadlock";
    case Errc::HeaderMismatch: return "HeaderMismatch";
    case Errc::PeerTimeout: return "PeerTimeout";
    case Errc::Aborted: return "Aborted";
    case Errc::Cuda: return "Cuda";
    case Errc::Nccl: return "Nccl";
    case Errc::Mpi: return "Mpi";
    case Errc::Internal: return "Internal";
    case Errc::NonFinite: return "NonFinite";
    case Errc::Rejected: return "Rejected";
  }
  return "Unknown";
}

/// The exception brigade throws. `what()` names the file, field or rank, the value seen and the
/// value expected; `code()` says which kind of failure it was.
class Error : public std::runtime_error {
 public:
  /// @param code    the failure kind
  /// @param message a sentence naming what was wrong, the value seen and the value expected
  Error(Errc code, const std::string& message) : std::runtime_error(message), code_(code) {}

  /// The failure kind.
  [[nodiscard]] Errc code() const noexcept { return code_; }

 private:
  Errc code_;
};

namespace detail {

/// A short, printable excerpt of untrusted text (a token of a file, a flag value) for an
/// error message: at most `max_bytes` bytes of it, bytes outside printable ASCII written as
/// \xNN, and, when cut, "..." and the full length in bytes. An error line never echoes a
/// whole hostile input (a 5 MB token is quoted as its first 32 bytes).
/// Example: excerpt("0F0\x01") == "0F0\\x01"; excerpt(std::string(5000000, 'a')) ==
/// "aaaa...a... (5000000 bytes)" (32 'a's).
inline std::string excerpt(std::string_view s, std::size_t max_bytes = 32) {
  std::string out;
  const std::size_t n = s.size() < max_bytes ? s.size() : max_bytes;
  out.reserve(n + 24);
  for (std::size_t i = 0; i < n; ++i) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b >= 0x20 && b < 0x7F && b != '\\')
      out.push_back(static_cast<char>(b));
    else
      out += fmt::format("\\x{:02X}", b);
  }
  if (n < s.size()) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

/// The single throw point: formats the message with fmt and throws brigade::Error.
/// @throws brigade::Error{code} always
template <class... Args>
[[noreturn]] void fail(Errc code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace detail
}  // namespace v0
}  // namespace brigade

/// Throws brigade::Error{errc} with the fmt-formatted message when `cond` is false.
#define BRIGADE_CHECK(cond, errc, ...)                   \
  do {                                                   \
    if (!(cond)) ::brigade::detail::fail(errc, __VA_ARGS__); \
  } while (false)
