// Reading files a user names (schedules, prompts, corpora, models, tokenizers) without trusting
// them: regular files only, a size limit per kind, and other formats named by their magic bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace brigade::io {
inline namespace v0 {

/// Size limits (bytes) of the inputs brigade reads whole into memory. A larger file is refused
/// by name before it is read (a schedule of 2^20 actions is about 8 MB of text).
inline constexpr std::uint64_t kMaxScheduleFileBytes = std::uint64_t{64} << 20;    ///< 64 MiB
inline constexpr std::uint64_t kMaxPromptFileBytes = std::uint64_t{64} << 20;      ///< 64 MiB
inline constexpr std::uint64_t kMaxTokenizerFileBytes = std::uint64_t{256} << 20;  ///< 256 MiB
inline constexpr std::uint64_t kMaxCorpusFileBytes = std::uint64_t{1} << 30;       ///< 1 GiB

/// What a non-regular file is, in words ("a directory", "a FIFO (named pipe)", "a character
/// device", "a block device", "a socket"), from its st_mode; empty for a regular file.
[[nodiscard]] std::string non_regular_kind(unsigned mode);

/// Checks that `path` names a readable regular file of at most `max_bytes` bytes and returns
/// its size in bytes. Symbolic links are followed (a link to /dev/zero is refused as a
/// character device).
/// @param what names the file's role in messages ("schedule file", "prompt file", ...)
/// @throws brigade::Error{BadFile} naming the path and `what` when the file does not exist,
///         cannot be opened, is not a regular file (saying which kind it is), or is larger than
///         `max_bytes` (its size and the limit)
std::uint64_t check_input_file(const std::filesystem::path& path, std::string_view what,
                               std::uint64_t max_bytes);

/// The whole content of `path` after check_input_file(path, what, max_bytes).
/// @throws brigade::Error{BadFile} as check_input_file, or on a read error
[[nodiscard]] std::string read_input_file(const std::filesystem::path& path, std::string_view what,
                                          std::uint64_t max_bytes);

/// Names the format of a file from its first bytes (`head`, at least 16 bytes when the file has
/// them) when it is one brigade does not read in that role: "a GGUF file (llama.cpp)" for
/// "GGUF", "a safetensors file" for a little-endian uint64 header length followed by '{"',
/// "a zip archive (PyTorch .pt/.pth checkpoints are zip archives)" for "PK\x03\x04", "a Python
/// pickle (an older PyTorch checkpoint)" for 0x80 and protocol 2..5, "an ELF executable or
/// library" for "\x7FELF", "a gzip archive", "a NumPy .npy array", "a PNG image", "a PDF
/// document". std::nullopt for anything else (llama2.c files have no magic).
[[nodiscard]] std::optional<std::string> foreign_format(std::string_view head);

/// The first `n` bytes of `path` (fewer when the file is shorter; empty when it cannot be read).
[[nodiscard]] std::string read_head(const std::filesystem::path& path, std::size_t n = 16);

}  // namespace v0
}  // namespace brigade::io
