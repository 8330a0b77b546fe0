// Internal: a whole file mapped read-only, for the readers of model files (llama2.c, GGUF,
// safetensors).
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
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace brigade::detail {

/// The descriptors of the files behind the live mappings OpenFile::map made, by mapping
/// address (the weight offload's posix_fadvise needs the file, the weights only hold the
/// mapping). Entries come and go with the mappings.
class MappedFiles {
 public:
  static MappedFiles& instance() {
    static MappedFiles m;
    return m;
  }
  void add(const void* base, int fd, std::size_t bytes) {
    std::lock_guard lock(mu_);
    fds_[base] = {fd, bytes};
  }
  void remove(const void* base) {
    std::lock_guard lock(mu_);
    fds_.erase(base);
  }
  /// The descriptor of the file mapped at `base` (open while the mapping lives), or -1.
  int fd(const void* base) const {
    std::lock_guard lock(mu_);
    const auto it = fds_.find(base);
    return it == fds_.end() ? -1 : it->second.first;
  }
  /// The length of the mapping at `base` in bytes, or 0.
  std::size_t bytes(const void* base) const {
    std::lock_guard lock(mu_);
    const auto it = fds_.find(base);
    return it == fds_.end() ? 0 : it->second.second;
  }

 private:
  mutable std::mutex mu_;
  std::map<const void*, std::pair<int, std::size_t>> fds_;
};

/// A read-only mapping of a whole regular file; `mapping` unmaps and closes it when the last
/// copy goes.
struct MappedFile {
  std::shared_ptr<const void> mapping;
  const std::byte* bytes = nullptr;
  std::uint64_t size = 0;
};

/// A regular file open for reading (open_file), not mapped yet: a reader may look at its head
/// or read it with pread(fd) before mapping it (map_open_file). Closes fd unless mapped.
class OpenFile {
 public:
  OpenFile(std::string name, int fd, std::uint64_t size)
      : name_(std::move(name)), fd_(fd), size_(size) {}
  OpenFile(OpenFile&& o) noexcept
      : name_(std::move(o.name_)), fd_(std::exchange(o.fd_, -1)), size_(o.size_) {}
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  OpenFile& operator=(OpenFile&&) = delete;
  ~OpenFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

  /// Maps the whole file read-only; the mapping then owns the descriptor.
  /// @throws brigade::Error{BadFile} naming the path if the size does not fit in size_t, the
  ///         file is empty, or mmap fails
  MappedFile map() {
    BRIGADE_CHECK(size_ <= std::numeric_limits<std::size_t>::max(), Errc::BadFile,
                  "{}: {} bytes do not fit in this process's address space", name_, size_);
    const auto length = static_cast<std::size_t>(size_);
    void* addr = ::mmap(nullptr, length, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (addr == MAP_FAILED)
      fail(Errc::BadFile, "{}: mmap of {} bytes failed: {}", name_, length,
           std::generic_category().message(errno));
    MappedFile m;
    m.size = size_;
    m.mapping = std::shared_ptr<const void>(addr, [length, fd = fd_](const void* p) {
      MappedFiles::instance().remove(p);
      ::munmap(const_cast<void*>(p), length);
      ::close(fd);
    });
    MappedFiles::instance().add(addr, fd_, length);
    fd_ = -1;
    m.bytes = static_cast<const std::byte*>(addr);
    return m;
  }

 private:
  std::string name_;
  int fd_;
  std::uint64_t size_;
};

/// Opens `path` for reading and checks it is a regular file. `what` names the kind of file in
/// messages ("GGUF file", "llama2.c checkpoint").
/// @throws brigade::Error{BadFile} naming the path when it is missing, cannot be opened or
///         stat'ed, or is not a regular file (saying which kind)
inline OpenFile open_file(const std::filesystem::path& path, std::string_view what) {
  std::string name = path.string();
  auto os = [](int e) { return std::generic_category().message(e); };
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) fail(Errc::BadFile, "{}: {} not found (no such file)", name, what);
    fail(Errc::BadFile, "{}: cannot open {}: {}", name, what, os(e));
  }
  struct stat st {};
  const int stat_rc = ::fstat(fd, &st);
  const int stat_errno = errno;
  OpenFile f(std::move(name), fd, static_cast<std::uint64_t>(st.st_size));
  if (stat_rc != 0) fail(Errc::BadFile, "{}: cannot stat {}: {}", f.name(), what, os(stat_errno));
  if (!S_ISREG(st.st_mode))
    fail(Errc::BadFile, "{}: is {}, not a regular file (expected a {})", f.name(),
         io::non_regular_kind(static_cast<unsigned>(st.st_mode)), what);
  return f;
}

/// Maps `path` read-only: open_file, then a file shorter than `min_bytes` (`min_what` describes
/// those bytes) is refused, then OpenFile::map.
/// @throws brigade::Error{BadFile} as open_file and OpenFile::map, and "<path>: file is N
///         bytes, shorter than <min_what> (M bytes)"
inline MappedFile map_file(const std::filesystem::path& path, std::string_view what,
                           std::uint64_t min_bytes, std::string_view min_what) {
  OpenFile f = open_file(path, what);
  if (f.size() < min_bytes)
    fail(Errc::BadFile, "{}: file is {} bytes, shorter than {} ({} bytes)", f.name(), f.size(),
         min_what, min_bytes);
  return f.map();
}

}  // namespace brigade::detail
