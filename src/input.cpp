// Untrusted input files: regular files under a size limit, and other formats named by magic.
#include "brigade/io/input.hpp"

#include "brigade/core/error.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

namespace brigade::io {
inline namespace v0 {
namespace {

std::string errno_text(int e) { return std::generic_category().message(e); }

/// Closes a file descriptor at scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

/// Opens `path` for reading without blocking on a FIFO (O_NONBLOCK), and checks it as
/// check_input_file documents; returns the open descriptor and the size.
std::uint64_t open_checked(const std::filesystem::path& path, std::string_view what,
                           std::uint64_t max_bytes, Fd& fd) {
  const std::string name = path.string();
  fd.fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd.fd < 0) {
    const int e = errno;
    if (e == ENOENT) detail::fail(Errc::BadFile, "{}: {} not found (no such file)", name, what);
    detail::fail(Errc::BadFile, "{}: cannot open the {}: {}", name, what, errno_text(e));
  }
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0)
    detail::fail(Errc::BadFile, "{}: cannot stat the {}: {}", name, what, errno_text(errno));
  const std::string kind = non_regular_kind(static_cast<unsigned>(st.st_mode));
  if (!kind.empty())
    detail::fail(Errc::BadFile, "{}: is {}, not a regular file (expected a {})", name, kind, what);
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes)
    detail::fail(Errc::BadFile, "{}: the {} is {} bytes, more than the limit of {} bytes", name,
                 what, size, max_bytes);
  // Reads below block normally again.
  const int flags = ::fcntl(fd.fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd.fd, F_SETFL, flags & ~O_NONBLOCK);
  return size;
}

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.substr(0, prefix.size()) == prefix;
}

}  // namespace

std::string non_regular_kind(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return {};
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO (named pipe)";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    default: return "not a regular file";
  }
}

std::uint64_t check_input_file(const std::filesystem::path& path, std::string_view what,
                               std::uint64_t max_bytes) {
  Fd fd;
  return open_checked(path, what, max_bytes, fd);
}

std::string read_input_file(const std::filesystem::path& path, std::string_view what,
                            std::uint64_t max_bytes) {
  Fd fd;
  const std::uint64_t size = open_checked(path, what, max_bytes, fd);
  std::string out(static_cast<std::size_t>(size), '\0');
  std::size_t got = 0;
  while (got < out.size()) {
    const ssize_t r = ::read(fd.fd, out.data() + got, out.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      detail::fail(Errc::BadFile, "{}: read error in the {}: {}", path.string(), what,
                   errno_text(errno));
    if (r == 0) break;  // the file shrank while being read
    got += static_cast<std::size_t>(r);
  }
  out.resize(got);
  return out;
}

std::optional<std::string> foreign_format(std::string_view h) {
  if (starts_with(h, "GGUF")) return "a GGUF file (llama.cpp)";
  if (starts_with(h, "PK\x03\x04"))
    return "a zip archive (PyTorch .pt/.pth checkpoints are zip archives)";
  if (h.size() >= 2 && static_cast<unsigned char>(h[0]) == 0x80 &&
      static_cast<unsigned char>(h[1]) >= 2 && static_cast<unsigned char>(h[1]) <= 5)
    return "a Python pickle (an older PyTorch checkpoint)";
  if (starts_with(h, "\x7F" "ELF")) return "an ELF executable or library";
  if (starts_with(h, "\x1F\x8B")) return "a gzip archive";
  if (starts_with(h, "\x93NUMPY")) return "a NumPy .npy array";
  if (starts_with(h, "\x89PNG")) return "a PNG image";
  if (starts_with(h, "%PDF")) return "a PDF document";
  // safetensors: uint64 little-endian JSON header length, then the JSON header itself.
  if (h.size() >= 10 && h[8] == '{' && (h[9] == '"' || h[9] == '}')) {
    std::uint64_t n = 0;
    std::memcpy(&n, h.data(), sizeof n);
    if (n >= 2 && n < (std::uint64_t{1} << 32)) return "a safetensors file";
  }
  return std::nullopt;
}

std::string read_head(const std::filesystem::path& path, std::size_t n) {
  Fd fd;
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd.fd < 0) return {};
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0 || !S_ISREG(st.st_mode)) return {};
  std::string out(n, '\0');
  const ssize_t r = ::pread(fd.fd, out.data(), n, 0);
  out.resize(r > 0 ? static_cast<std::size_t>(r) : 0);
  return out;
}

}  // namespace v0
}  // namespace brigade::io
