// Internal: a whole file mapped read-only, for the readers of model files (GGUF, safetensors).
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/io/input.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>

namespace brigade::detail {

/// A read-only mapping of a whole regular file; `mapping` unmaps and closes it when the last
/// copy goes.
struct MappedFile {
  std::shared_ptr<const void> mapping;
  const std::byte* bytes = nullptr;
  std::uint64_t size = 0;
};

/// Maps `path` read-only. `what` names the kind of file in messages ("GGUF file").
/// @throws brigade::Error{BadFile} naming the path when it is missing, cannot be opened or
///         stat'ed, is not a regular file (saying which kind), is shorter than `min_bytes`
///         (`min_what` describes those bytes), or cannot be mapped
inline MappedFile map_file(const std::filesystem::path& path, std::string_view what,
                           std::uint64_t min_bytes, std::string_view min_what) {
  const std::string name = path.string();
  auto os = [](int e) { return std::generic_category().message(e); };
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) fail(Errc::BadFile, "{}: {} not found (no such file)", name, what);
    fail(Errc::BadFile, "{}: cannot open {}: {}", name, what, os(e));
  }
  struct FdGuard {
    int fd;
    bool armed = true;
    ~FdGuard() {
      if (armed) ::close(fd);
    }
  } guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(Errc::BadFile, "{}: cannot stat {}: {}", name, what, os(errno));
  if (!S_ISREG(st.st_mode))
    fail(Errc::BadFile, "{}: is {}, not a regular file (expected a {})", name,
         io::non_regular_kind(static_cast<unsigned>(st.st_mode)), what);
  MappedFile m;
  m.size = static_cast<std::uint64_t>(st.st_size);
  if (m.size < min_bytes)
    fail(Errc::BadFile, "{}: file is {} bytes, shorter than {} ({} bytes)", name, m.size,
         min_what, min_bytes);
  BRIGADE_CHECK(m.size <= std::numeric_limits<std::size_t>::max(), Errc::BadFile,
                "{}: {} bytes do not fit in this process's address space", name, m.size);
  const auto length = static_cast<std::size_t>(m.size);
  void* addr = ::mmap(nullptr, length, PROT_READ, MAP_PRIVATE, fd, 0);
  if (addr == MAP_FAILED)
    fail(Errc::BadFile, "{}: mmap of {} bytes failed: {}", name, length, os(errno));
  guard.armed = false;
  m.mapping = std::shared_ptr<const void>(addr, [length, fd](const void* p) {
    ::munmap(const_cast<void*>(p), length);
    ::close(fd);
  });
  m.bytes = static_cast<const std::byte*>(addr);
  return m;
}

}  // namespace brigade::detail
