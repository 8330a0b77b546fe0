// GGUF: the checked reader over mmap (GgufFile), the Llama mapping, the tokenizer from metadata
// and the v3 writer. docs/formats.md ("GGUF") lists every check in the order they run.
#include "brigade/model/gguf.hpp"

#include "brigade/core/error.hpp"
#include "brigade/core/finite.hpp"
#include "brigade/io/input.hpp"
#include "layer_tensor.hpp"
#include "mapped_file.hpp"

#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <system_error>
#include <utility>

namespace brigade::model {
inline namespace v0 {
namespace {

static_assert(std::endian::native == std::endian::little,
              "brigade reads GGUF files in place, which needs a little-endian host");

constexpr std::uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr std::uint64_t kHeaderBytes = 4 + 4 + 8 + 8;
constexpr std::uint64_t kMaxKeyBytes = 65535;   // the specification's limit on a key
constexpr std::uint64_t kMaxNameBytes = 64;     // the specification's limit on a tensor name
constexpr std::uint32_t kMaxDims = 4;           // GGML_MAX_DIMS

// ggml_type numbers brigade reads.
constexpr std::uint32_t kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ8_0 = 8, kGgmlBF16 = 30;

/// llama.cpp's names of the ggml types, by number ("" for numbers retired from the enum).
constexpr std::array<std::string_view, 40> kGgmlNames = {
    "f32",     "f16",    "q4_0",    "q4_1",   "",        "",       "q5_0",   "q5_1",
    "q8_0",    "q8_1",   "q2_K",    "q3_K",   "q4_K",    "q5_K",   "q6_K",   "q8_K",
    "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s",  "iq4_nl",  "iq3_s",  "iq2_s",  "iq4_xs",
    "i8",      "i16",    "i32",     "i64",    "f64",     "iq1_m",  "bf16",   "",
    "",        "",       "tq1_0",   "tq2_0",  "",        "",       "",       "mxfp4"};

std::optional<DType> dtype_of_ggml(std::uint32_t t) {
  switch (t) {
    case kGgmlF32: return DType::F32;
    case kGgmlF16: return DType::F16;
    case kGgmlQ8_0: return DType::Q8_0;
    case kGgmlBF16: return DType::BF16;
    default: return std::nullopt;
  }
}

std::uint32_t ggml_of_dtype(DType t) {
  switch (t) {
    case DType::F16: return kGgmlF16;
    case DType::BF16: return kGgmlBF16;
    case DType::Q8_0: return kGgmlQ8_0;
    default: return kGgmlF32;
  }
}

/// Bytes of one element of a fixed-size value type; 0 for String and Array.
std::uint64_t scalar_bytes(GgufValueType t) {
  switch (t) {
    case GgufValueType::U8:
    case GgufValueType::I8:
    case GgufValueType::Bool: return 1;
    case GgufValueType::U16:
    case GgufValueType::I16: return 2;
    case GgufValueType::U32:
    case GgufValueType::I32:
    case GgufValueType::F32: return 4;
    case GgufValueType::U64:
    case GgufValueType::I64:
    case GgufValueType::F64: return 8;
    default: return 0;
  }
}

bool is_integer(GgufValueType t) {
  switch (t) {
    case GgufValueType::U8:
    case GgufValueType::I8:
    case GgufValueType::U16:
    case GgufValueType::I16:
    case GgufValueType::U32:
    case GgufValueType::I32:
    case GgufValueType::U64:
    case GgufValueType::I64: return true;
    default: return false;
  }
}

/// Decodes one fixed-size scalar at `p` into `v` (bits or number).
void decode_scalar(GgufValueType t, const std::byte* p, GgufValue& v) {
  auto load = [p]<typename T>(T) {
    T x;
    std::memcpy(&x, p, sizeof x);
    return x;
  };
  switch (t) {
    case GgufValueType::U8: v.bits = load(std::uint8_t{}); break;
    case GgufValueType::I8: v.bits = static_cast<std::uint64_t>(std::int64_t{load(std::int8_t{})}); break;
    case GgufValueType::U16: v.bits = load(std::uint16_t{}); break;
    case GgufValueType::I16: v.bits = static_cast<std::uint64_t>(std::int64_t{load(std::int16_t{})}); break;
    case GgufValueType::U32: v.bits = load(std::uint32_t{}); break;
    case GgufValueType::I32: v.bits = static_cast<std::uint64_t>(std::int64_t{load(std::int32_t{})}); break;
    case GgufValueType::U64: v.bits = load(std::uint64_t{}); break;
    case GgufValueType::I64: v.bits = static_cast<std::uint64_t>(load(std::int64_t{})); break;
    case GgufValueType::Bool: v.bits = load(std::uint8_t{}); break;
    case GgufValueType::F32: v.number = static_cast<double>(load(float{})); break;
    case GgufValueType::F64: v.number = load(double{}); break;
    default: break;
  }
}

std::string errno_text(int e) { return std::generic_category().message(e); }

/// Reads the file front to back, every length checked against what remains.
class Cursor {
 public:
  Cursor(const std::string& file, const std::byte* base, std::uint64_t size)
      : file_(file), base_(base), size_(size) {}

  [[nodiscard]] std::uint64_t pos() const { return pos_; }
  [[nodiscard]] std::uint64_t left() const { return size_ - pos_; }

  /// Throws unless `n` bytes remain; `what` describes the field being read.
  template <typename Describe>
  void need(std::uint64_t n, Describe&& what) const {
    if (n > left())
      detail::fail(Errc::BadFile,
                   "{}: {} needs {} bytes at offset {}, but the file ends {} bytes later (file "
                   "is {} bytes)",
                   file_, what(), n, pos_, left(), size_);
  }

  template <typename T, typename Describe>
  T read(Describe&& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }

  /// A GGUF string: uint64 length, then the bytes.
  template <typename Describe>
  std::string_view string(Describe&& what) {
    const auto n = read<std::uint64_t>([&] { return fmt::format("the length of {}", what()); });
    if (n > left())
      detail::fail(Errc::BadFile,
                   "{}: {} has length {} at offset {}, past the end of the file ({} bytes "
                   "remain, file is {} bytes)",
                   file_, what(), n, pos_ - 8, left(), size_);
    std::string_view s(reinterpret_cast<const char*>(base_ + pos_), static_cast<std::size_t>(n));
    pos_ += n;
    return s;
  }

  const std::byte* take(std::uint64_t n) {
    const std::byte* p = base_ + pos_;
    pos_ += n;
    return p;
  }

 private:
  const std::string& file_;
  const std::byte* base_;
  std::uint64_t size_;
  std::uint64_t pos_ = 0;
};

/// Transparent hash so lookups by string_view do not allocate.
struct NameHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept {
    return std::hash<std::string_view>{}(s);
  }
};
template <typename V>
using NameMap = std::unordered_map<std::string, V, NameHash, std::equal_to<>>;

}  // namespace

std::string_view to_string(GgufValueType t) noexcept {
  constexpr std::array<std::string_view, 13> names = {
      "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
      "bool",  "string", "array", "uint64", "int64", "float64"};
  const auto i = static_cast<std::uint32_t>(t);
  return i < names.size() ? names[i] : "unknown";
}

std::string_view ggml_type_name(std::uint32_t type) noexcept {
  if (type < kGgmlNames.size() && !kGgmlNames[type].empty()) return kGgmlNames[type];
  return "unknown";
}

struct GgufFile::Impl {
  std::filesystem::path path;
  std::string name;  // path as text, for messages
  std::shared_ptr<const void> mapping;
  std::uint64_t size = 0;
  std::uint32_t version = 0;
  std::uint64_t alignment = kDefaultAlignment;
  std::uint64_t data_offset = 0;
  std::vector<std::string> keys;
  NameMap<GgufValue> values;
  std::vector<GgufTensor> tensors;
  NameMap<std::size_t> tensor_index;

  /// Reads one value of type `t` (depth: arrays enclosing it).
  GgufValue read_value(Cursor& c, GgufValueType t, std::string_view key, int depth) {
    GgufValue v;
    v.type = t;
    auto what = [&] { return fmt::format("metadata key '{}' ({})", detail::excerpt(key, 64), to_string(t)); };
    if (const std::uint64_t n = scalar_bytes(t)) {
      c.need(n, what);
      decode_scalar(t, c.take(n), v);
      if (t == GgufValueType::Bool && v.bits > 1)
        detail::fail(Errc::BadFile, "{}: metadata key '{}' is a bool of value {}, expected 0 or 1",
                     name, detail::excerpt(key, 64), v.bits);
      return v;
    }
    if (t == GgufValueType::String) {
      v.string = c.string(what);
      return v;
    }
    // Array: element type, count, elements.
    if (depth + 1 > kMaxArrayDepth)
      detail::fail(Errc::BadFile,
                   "{}: metadata key '{}' nests arrays {} deep at offset {}, more than brigade's "
                   "limit of {}",
                   name, detail::excerpt(key, 64), depth + 1, c.pos(), kMaxArrayDepth);
    const auto et = c.read<std::uint32_t>([&] {
      return fmt::format("the element type of array '{}'", detail::excerpt(key, 64));
    });
    if (et > static_cast<std::uint32_t>(GgufValueType::F64))
      detail::fail(Errc::BadFile,
                   "{}: metadata key '{}' is an array of value type {} at offset {}, expected a "
                   "GGUF value type 0..12",
                   name, detail::excerpt(key, 64), et, c.pos() - 4);
    v.element_type = static_cast<GgufValueType>(et);
    v.count = c.read<std::uint64_t>([&] {
      return fmt::format("the element count of array '{}'", detail::excerpt(key, 64));
    });
    // Each element takes at least `least` bytes: a bound on the count before anything is
    // reserved, so a count of 2^62 is refused here.
    const std::uint64_t each = scalar_bytes(v.element_type);
    const std::uint64_t least = each ? each : (v.element_type == GgufValueType::String ? 8 : 12);
    if (v.count > c.left() / least)
      detail::fail(Errc::BadFile,
                   "{}: metadata key '{}' is an array of {} {} elements at offset {}, which need "
                   "at least {} bytes each, but {} bytes remain in the file",
                   name, detail::excerpt(key, 64), v.count, to_string(v.element_type),
                   c.pos() - 8, least, c.left());
    if (each) {
      if (v.element_type == GgufValueType::Bool) {
        const std::byte* p = c.take(0);
        for (std::uint64_t i = 0; i < v.count; ++i)
          if (std::to_integer<unsigned>(p[i]) > 1)
            detail::fail(Errc::BadFile,
                         "{}: metadata key '{}' element {} is a bool of value {}, expected 0 or 1",
                         name, detail::excerpt(key, 64), i, std::to_integer<unsigned>(p[i]));
      }
      v.elements = c.take(v.count * each);
    } else if (v.element_type == GgufValueType::String) {
      v.strings.reserve(static_cast<std::size_t>(v.count));
      for (std::uint64_t i = 0; i < v.count; ++i)
        v.strings.push_back(c.string([&] {
          return fmt::format("element {} of array '{}'", i, detail::excerpt(key, 64));
        }));
    } else {
      v.arrays.reserve(static_cast<std::size_t>(v.count));
      for (std::uint64_t i = 0; i < v.count; ++i)
        v.arrays.push_back(read_value(c, GgufValueType::Array, key, depth + 1));
    }
    return v;
  }

  void parse(const std::byte* base) {
    Cursor c(name, base, size);
    const auto magic = c.read<std::uint32_t>([] { return std::string("the magic"); });
    if (magic != kMagic) {
      const std::string head(reinterpret_cast<const char*>(base),
                             static_cast<std::size_t>(std::min<std::uint64_t>(size, 16)));
      const auto other = io::foreign_format(head);
      detail::fail(Errc::BadFile, "{}: starts with '{}', not the GGUF magic 'GGUF'{}", name,
                   detail::excerpt(head.substr(0, 4)),
                   other ? fmt::format(" (it is {})", *other) : std::string());
    }
    version = c.read<std::uint32_t>([] { return std::string("the version"); });
    if (version != 2 && version != 3)
      detail::fail(Errc::BadFile,
                   "{}: GGUF version {}, expected 2 or 3{}", name, version,
                   version == 1 ? " (version 1 is the pre-2023 layout with 32-bit counts; "
                                  "convert it with a current llama.cpp)"
                   : __builtin_bswap32(version) == 2 || __builtin_bswap32(version) == 3
                       ? " (a big-endian GGUF file: brigade reads little-endian files)"
                       : "");
    const auto n_tensors = c.read<std::uint64_t>([] { return std::string("the tensor count"); });
    const auto n_kv = c.read<std::uint64_t>([] { return std::string("the metadata key/value count"); });
    // A key/value takes at least 13 bytes (key length, value type, a uint8), a tensor info at
    // least 32 (name length, dimension count, one dimension, type, offset).
    if (n_kv > c.left() / 13)
      detail::fail(Errc::BadFile,
                   "{}: metadata key/value count {} at offset 16 needs at least {} bytes each, but "
                   "{} bytes remain in the file",
                   name, n_kv, 13, c.left());
    if (n_tensors > c.left() / 32)
      detail::fail(Errc::BadFile,
                   "{}: tensor count {} at offset 8 needs at least {} bytes each, but {} bytes "
                   "remain in the file",
                   name, n_tensors, 32, c.left());

    keys.reserve(static_cast<std::size_t>(n_kv));
    for (std::uint64_t i = 0; i < n_kv; ++i) {
      const std::uint64_t at = c.pos();
      const std::string_view key = c.string([&] { return fmt::format("metadata key {}", i); });
      if (key.size() > kMaxKeyBytes)
        detail::fail(Errc::BadFile, "{}: metadata key {} at offset {} is {} bytes, expected at most {}",
                     name, i, at, key.size(), kMaxKeyBytes);
      const auto t = c.read<std::uint32_t>([&] {
        return fmt::format("the value type of metadata key '{}'", detail::excerpt(key, 64));
      });
      if (t > static_cast<std::uint32_t>(GgufValueType::F64))
        detail::fail(Errc::BadFile,
                     "{}: metadata key '{}' has value type {} at offset {}, expected a GGUF value "
                     "type 0..12",
                     name, detail::excerpt(key, 64), t, c.pos() - 4);
      GgufValue v = read_value(c, static_cast<GgufValueType>(t), key, 0);
      const auto [it, fresh] = values.emplace(std::string(key), std::move(v));
      if (!fresh)
        detail::fail(Errc::BadFile, "{}: metadata key '{}' appears twice (the second at offset {})",
                     name, detail::excerpt(key, 64), at);
      keys.emplace_back(key);
    }

    if (const auto it = values.find("general.alignment"); it != values.end()) {
      const GgufValue& a = it->second;
      if (a.type != GgufValueType::U32)
        detail::fail(Errc::BadFile, "{}: metadata key 'general.alignment' is {}, expected uint32",
                     name, to_string(a.type));
      if (a.bits == 0 || !std::has_single_bit(a.bits))
        detail::fail(Errc::BadFile,
                     "{}: metadata key 'general.alignment' = {}, expected a power of two", name,
                     a.bits);
      alignment = a.bits;
    }

    tensors.reserve(static_cast<std::size_t>(n_tensors));
    for (std::uint64_t i = 0; i < n_tensors; ++i) {
      GgufTensor t;
      const std::uint64_t at = c.pos();
      t.name = std::string(c.string([&] { return fmt::format("the name of tensor {}", i); }));
      const std::string tn = detail::excerpt(t.name, 80);
      if (t.name.size() > kMaxNameBytes)
        detail::fail(Errc::BadFile, "{}: tensor {} ('{}') at offset {} has a name of {} bytes, expected at most {}",
                     name, i, tn, at, t.name.size(), kMaxNameBytes);
      const auto n_dims = c.read<std::uint32_t>([&] { return fmt::format("the dimension count of tensor {}", tn); });
      if (n_dims == 0 || n_dims > kMaxDims)
        detail::fail(Errc::BadFile, "{}: tensor {} has {} dimensions, expected 1 to {}", name, tn,
                     n_dims, kMaxDims);
      std::uint64_t elements = 1;
      for (std::uint32_t d = 0; d < n_dims; ++d) {
        const auto n = c.read<std::uint64_t>([&] { return fmt::format("dimension {} of tensor {}", d, tn); });
        if (n == 0 || n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
          detail::fail(Errc::BadFile, "{}: tensor {} has dimension {} = {}, expected 1 to 2^63-1",
                       name, tn, d, n);
        if (__builtin_mul_overflow(elements, n, &elements) ||
            elements > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
          detail::fail(Errc::BadFile,
                       "{}: tensor {} has a shape whose element count overflows 64 bits "
                       "(dimension {} = {})",
                       name, tn, d, n);
        t.shape.push_back(static_cast<std::int64_t>(n));
      }
      t.elements = static_cast<std::int64_t>(elements);
      t.ggml_type = c.read<std::uint32_t>([&] { return fmt::format("the type of tensor {}", tn); });
      const std::optional<DType> dt = dtype_of_ggml(t.ggml_type);
      if (!dt)
        detail::fail(Errc::BadFile,
                     "{}: tensor {} has ggml type {} ({}), which brigade does not read (it reads "
                     "f32, f16, bf16 and q8_0)",
                     name, tn, ggml_type_name(t.ggml_type), t.ggml_type);
      t.dtype = *dt;
      const auto block = static_cast<std::uint64_t>(dtype_block_elements(t.dtype));
      if (static_cast<std::uint64_t>(t.shape[0]) % block != 0)
        detail::fail(Errc::BadFile,
                     "{}: tensor {} of type {} has rows of {} elements, expected a multiple of its "
                     "block of {}",
                     name, tn, to_string(t.dtype), t.shape[0], block);
      t.bytes = elements / block * dtype_block_bytes(t.dtype);  // <= elements * 4: no overflow
      t.offset = c.read<std::uint64_t>([&] { return fmt::format("the data offset of tensor {}", tn); });
      if (t.offset % alignment != 0)
        detail::fail(Errc::BadFile,
                     "{}: tensor {} has data offset {}, expected a multiple of the alignment {}",
                     name, tn, t.offset, alignment);
      if (!tensor_index.emplace(t.name, tensors.size()).second)
        detail::fail(Errc::BadFile, "{}: tensor {} appears twice (tensors {} and {})", name, tn,
                     tensor_index.find(t.name)->second, i);
      tensors.push_back(std::move(t));
    }

    // The data section starts at the next multiple of the alignment.
    const std::uint64_t info_end = c.pos();
    data_offset = info_end + (alignment - info_end % alignment) % alignment;
    if (!tensors.empty() && data_offset > size)
      detail::fail(Errc::BadFile,
                   "{}: the data section would start at offset {} (tensor infos end at {}, "
                   "alignment {}), past the end of the file ({} bytes)",
                   name, data_offset, info_end, alignment, size);
    const std::uint64_t data_bytes = tensors.empty() ? 0 : size - data_offset;

    // Every tensor inside the data section, and no two overlapping.
    std::vector<std::size_t> order(tensors.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    for (const GgufTensor& t : tensors)
      if (t.offset > data_bytes || t.bytes > data_bytes - t.offset)
        detail::fail(Errc::BadFile,
                     "{}: tensor {} ({}, {} elements, {} bytes at data offset {}) runs past the "
                     "end of the file: the data section at file offset {} holds {} bytes (file "
                     "is {} bytes)",
                     name, detail::excerpt(t.name, 80), to_string(t.dtype), t.elements, t.bytes,
                     t.offset, data_offset, data_bytes, size);
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return tensors[a].offset < tensors[b].offset; });
    for (std::size_t k = 1; k < order.size(); ++k) {
      const GgufTensor& prev = tensors[order[k - 1]];
      const GgufTensor& next = tensors[order[k]];
      if (prev.offset + prev.bytes > next.offset)
        detail::fail(Errc::BadFile,
                     "{}: tensors {} (data offset {}, {} bytes) and {} (data offset {}) overlap",
                     name, detail::excerpt(prev.name, 80), prev.offset, prev.bytes,
                     detail::excerpt(next.name, 80), next.offset);
    }
    for (GgufTensor& t : tensors) {
      t.data = base + data_offset + t.offset;
      // Element access needs natural alignment (the data section's alignment may be 1).
      const std::size_t need = t.dtype == DType::F32 ? 4 : 2;
      if (reinterpret_cast<std::uintptr_t>(t.data) % need != 0)
        detail::fail(Errc::BadFile,
                     "{}: tensor {} starts at file offset {}, not a multiple of {} bytes as its "
                     "type {} needs",
                     name, detail::excerpt(t.name, 80), data_offset + t.offset, need,
                     to_string(t.dtype));
    }
  }

  [[noreturn]] void wrong_type(std::string_view key, const GgufValue& v,
                               std::string_view expected) const {
    detail::fail(Errc::BadFile, "{}: metadata key '{}' is {}{}, expected {}", name, key,
                 to_string(v.type),
                 v.type == GgufValueType::Array ? fmt::format(" of {}", to_string(v.element_type))
                                                : std::string(),
                 expected);
  }

  const GgufValue& must(std::string_view key) const {
    const auto it = values.find(key);
    if (it == values.end())
      detail::fail(Errc::BadFile, "{}: metadata key '{}' is missing", name, key);
    return it->second;
  }

  std::int64_t integer(std::string_view key, GgufValueType t, std::uint64_t bits) const {
    if (t == GgufValueType::U64 && bits > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      detail::fail(Errc::BadFile, "{}: metadata key '{}' = {}, more than 2^63-1", name, key, bits);
    return static_cast<std::int64_t>(bits);
  }
};

GgufFile::GgufFile() = default;
GgufFile::GgufFile(const GgufFile&) = default;
GgufFile& GgufFile::operator=(const GgufFile&) = default;
GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

GgufFile GgufFile::open(const std::filesystem::path& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  impl->name = path.string();
  const detail::MappedFile m = detail::map_file(
      path, "GGUF file", kHeaderBytes,
      "the GGUF header (magic, version, tensor count, metadata count)");
  impl->mapping = m.mapping;
  impl->size = m.size;
  impl->parse(m.bytes);
  GgufFile f;
  f.impl_ = std::move(impl);
  return f;
}

const std::filesystem::path& GgufFile::path() const noexcept { return impl_->path; }
std::uint32_t GgufFile::version() const noexcept { return impl_->version; }
std::uint64_t GgufFile::alignment() const noexcept { return impl_->alignment; }
std::uint64_t GgufFile::data_offset() const noexcept { return impl_->data_offset; }
std::uint64_t GgufFile::file_bytes() const noexcept { return impl_->size; }
std::shared_ptr<const void> GgufFile::storage() const noexcept { return impl_->mapping; }
const std::vector<std::string>& GgufFile::keys() const noexcept { return impl_->keys; }
const std::vector<GgufTensor>& GgufFile::tensors() const noexcept { return impl_->tensors; }

const GgufValue* GgufFile::find(std::string_view key) const noexcept {
  const auto it = impl_->values.find(key);
  return it == impl_->values.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::find_tensor(std::string_view name) const noexcept {
  const auto it = impl_->tensor_index.find(name);
  return it == impl_->tensor_index.end() ? nullptr : &impl_->tensors[it->second];
}

std::int64_t GgufFile::get_int(std::string_view key) const {
  const GgufValue& v = impl_->must(key);
  if (!is_integer(v.type)) impl_->wrong_type(key, v, "an integer");
  return impl_->integer(key, v.type, v.bits);
}

double GgufFile::get_float(std::string_view key) const {
  const GgufValue& v = impl_->must(key);
  if (v.type != GgufValueType::F32 && v.type != GgufValueType::F64)
    impl_->wrong_type(key, v, "float32 or float64");
  return v.number;
}

bool GgufFile::get_bool(std::string_view key) const {
  const GgufValue& v = impl_->must(key);
  if (v.type != GgufValueType::Bool) impl_->wrong_type(key, v, "bool");
  return v.bits != 0;
}

std::string_view GgufFile::get_string(std::string_view key) const {
  const GgufValue& v = impl_->must(key);
  if (v.type != GgufValueType::String) impl_->wrong_type(key, v, "string");
  return v.string;
}

const std::vector<std::string_view>& GgufFile::get_strings(std::string_view key) const {
  const GgufValue& v = impl_->must(key);
  if (v.type != GgufValueType::Array || v.element_type != GgufValueType::String)
    impl_->wrong_type(key, v, "an array of string");
  return v.strings;
}

std::vector<float> GgufFile::get_floats(std::string_view key) const {
  const GgufValue& v = impl_->must(key);
  if (v.type != GgufValueType::Array ||
      (v.element_type != GgufValueType::F32 && v.element_type != GgufValueType::F64))
    impl_->wrong_type(key, v, "an array of float32 or float64");
  std::vector<float> out(static_cast<std::size_t>(v.count));
  const std::uint64_t each = scalar_bytes(v.element_type);
  for (std::size_t i = 0; i < out.size(); ++i) {
    GgufValue x;
    decode_scalar(v.element_type, v.elements + i * each, x);
    out[i] = static_cast<float>(x.number);
  }
  return out;
}

std::vector<std::int64_t> GgufFile::get_ints(std::string_view key) const {
  const GgufValue& v = impl_->must(key);
  if (v.type != GgufValueType::Array || !is_integer(v.element_type))
    impl_->wrong_type(key, v, "an array of integers");
  std::vector<std::int64_t> out(static_cast<std::size_t>(v.count));
  const std::uint64_t each = scalar_bytes(v.element_type);
  for (std::size_t i = 0; i < out.size(); ++i) {
    GgufValue x;
    decode_scalar(v.element_type, v.elements + i * each, x);
    out[i] = impl_->integer(key, v.element_type, x.bits);
  }
  return out;
}

// ---- Llama mapping ------------------------------------------------------------------------

namespace {

/// The per-layer tensors of a llama GGUF, in brigade's DecoderWeights order.
constexpr std::array<LayerTensor, 9> kLayerTensors = {{
    {"attn_norm", &DecoderWeights::rms_att, nullptr},
    {"attn_q", nullptr, &DecoderWeights::wq},
    {"attn_k", nullptr, &DecoderWeights::wk},
    {"attn_v", nullptr, &DecoderWeights::wv},
    {"attn_output", nullptr, &DecoderWeights::wo},
    {"ffn_norm", &DecoderWeights::rms_ffn, nullptr},
    {"ffn_gate", nullptr, &DecoderWeights::w1},
    {"ffn_down", nullptr, &DecoderWeights::w2},
    {"ffn_up", nullptr, &DecoderWeights::w3},
}};

/// ggml shape {in, out} of a per-layer tensor (1-D {dim} for the norms).
std::vector<std::int64_t> layer_shape(std::string_view suffix, const LlamaConfig& c) {
  const std::int64_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim();
  if (suffix == "attn_norm" || suffix == "ffn_norm") return {d};
  if (suffix == "attn_k" || suffix == "attn_v") return {d, kv};
  if (suffix == "ffn_gate" || suffix == "ffn_up") return {d, h};
  if (suffix == "ffn_down") return {h, d};
  return {d, d};  // attn_q, attn_output
}

std::string shape_text(const std::vector<std::int64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

/// Throws if an element of tensor `t` is NaN or infinite, naming the tensor and the element.
void check_finite_tensor(const GgufFile& f, const GgufTensor& t) {
  const auto cols = static_cast<std::size_t>(t.shape[0]);
  const std::int64_t rows = cols == 0 ? 0 : t.elements / static_cast<std::int64_t>(cols);
  const std::size_t i = first_non_finite_weight(WeightMatrix(t.data, t.dtype), rows,
                                         static_cast<std::int64_t>(cols));
  if (i != static_cast<std::size_t>(t.elements))
    detail::fail(Errc::BadFile,
                 "{}: tensor {}, element {} (row {}, column {}) is not finite: a model's weights "
                 "must be finite",
                 f.path().string(), t.name, i, i / cols, i % cols);
}

/// A matrix tensor as a typed view into the mapping (f32, f16, bf16 or q8_0, kept in its dtype:
/// the kernels read it), after a scan for non-finite values unless `scan` is false (the scan
/// deferred: LoadOptions::defer_finite_check).
/// @throws brigade::Error{BadFile} naming the tensor for another dtype, a q8_0 row that is not
///         whole blocks, or a non-finite element (row and column)
WeightMatrix matrix_data(const GgufFile& f, const GgufTensor& t, bool scan) {
  if (!is_weight_dtype(t.dtype))
    detail::fail(Errc::BadFile, "{}: tensor {} is {}; brigade reads weight matrices in f32, f16, "
                 "bf16 and q8_0", f.path().string(), t.name, to_string(t.dtype));
  const auto cols = static_cast<std::size_t>(t.shape[0]);
  if (t.dtype == DType::Q8_0 && cols % 32 != 0)
    detail::fail(Errc::BadFile, "{}: tensor {} is q8_0 with rows of {} values, not whole blocks "
                 "of 32", f.path().string(), t.name, cols);
  if (scan) check_finite_tensor(f, t);
  return WeightMatrix(t.data, t.dtype);
}

/// A norm gain ([dim]): float32, as llama.cpp writes them in every file type.
/// @throws brigade::Error{BadFile} naming the tensor for another dtype or a non-finite element
const float* gain_data(const GgufFile& f, const GgufTensor& t, bool scan) {
  if (t.dtype != DType::F32)
    detail::fail(Errc::BadFile, "{}: tensor {} is {}; norm gains must be f32", f.path().string(),
                 t.name, to_string(t.dtype));
  return matrix_data(f, t, scan).f32();
}

/// The scan load_gguf_llama defers: the tensors of ModelSpec layers [first, last) of the
/// model in `f` (the LM head of a shared classifier is token_embd).
void check_finite_layers(const GgufFile& f, const LlamaConfig& c, int first, int last) {
  auto scan = [&](const std::string& name) { check_finite_tensor(f, *f.find_tensor(name)); };
  const int L = c.n_layers;
  for (int s = std::max(first, 0); s < std::min(last, L + 3); ++s) {
    if (s == 0) {
      scan("token_embd.weight");
    } else if (s <= L) {
      for (const LayerTensor& lt : kLayerTensors) scan(fmt::format("blk.{}.{}.weight", s - 1, lt.suffix));
    } else if (s == L + 1) {
      scan("output_norm.weight");
    } else if (!c.shared_classifier) {
      scan("output.weight");
    } else if (first > 0) {
      scan("token_embd.weight");
    }
  }
}

/// A positive int metadata value (the config's fields are int).
int config_int(const GgufFile& f, std::string_view key) {
  const std::int64_t v = f.get_int(key);
  if (v <= 0 || v > std::numeric_limits<int>::max())
    detail::fail(Errc::BadFile, "{}: metadata key '{}' = {}, expected 1 to {}", f.path().string(),
                 key, v, std::numeric_limits<int>::max());
  return static_cast<int>(v);
}

}  // namespace

LlamaWeights load_gguf_llama(const GgufFile& f, const LoadOptions& options) {
  const std::string name = f.path().string();
  const std::string_view arch = f.get_string("general.architecture");
  if (arch != "llama")
    detail::fail(Errc::BadFile,
                 "{}: metadata key 'general.architecture' = '{}', expected 'llama' (brigade runs "
                 "Llama-architecture models)",
                 name, detail::excerpt(arch, 64));
  LlamaWeights w;
  LlamaConfig& c = w.config;
  c.dim = config_int(f, "llama.embedding_length");
  c.hidden_dim = config_int(f, "llama.feed_forward_length");
  c.n_layers = config_int(f, "llama.block_count");
  c.n_heads = config_int(f, "llama.attention.head_count");
  c.n_kv_heads = f.find("llama.attention.head_count_kv")
                     ? config_int(f, "llama.attention.head_count_kv")
                     : c.n_heads;
  c.seq_len = config_int(f, "llama.context_length");
  if (f.find("llama.rope.freq_base")) {
    c.rope_theta = static_cast<float>(f.get_float("llama.rope.freq_base"));
    BRIGADE_CHECK(std::isfinite(c.rope_theta) && c.rope_theta > 1.0f, Errc::BadFile,
                  "{}: metadata key 'llama.rope.freq_base' = {}, expected a finite number > 1",
                  name, c.rope_theta);
  }
  if (f.find("llama.attention.layer_norm_rms_epsilon")) {
    c.norm_eps = static_cast<float>(f.get_float("llama.attention.layer_norm_rms_epsilon"));
    BRIGADE_CHECK(std::isfinite(c.norm_eps) && c.norm_eps > 0.0f && c.norm_eps < 1.0f,
                  Errc::BadFile,
                  "{}: metadata key 'llama.attention.layer_norm_rms_epsilon' = {}, expected a "
                  "number in (0, 1)",
                  name, c.norm_eps);
  }
  for (const std::string_view key : {"llama.rope.scaling.type", "llama.rope.scaling.factor"}) {
    if (!f.find(key)) continue;
    if (key.ends_with("type") && f.get_string(key) == "none") continue;
    if (key.ends_with("factor") && f.get_float(key) == 1.0) continue;
    detail::fail(Errc::BadFile,
                 "{}: metadata key '{}' is set: RoPE scaling (linear, YaRN, ...) is not "
                 "implemented in brigade, which would give wrong tokens",
                 name, key);
  }
  // Vocabulary: the rows of token_embd.
  const GgufTensor* embd = f.find_tensor("token_embd.weight");
  if (!embd) detail::fail(Errc::BadFile, "{}: tensor token_embd.weight is missing", name);
  if (embd->shape.size() != 2 || embd->shape[1] > std::numeric_limits<int>::max())
    detail::fail(Errc::BadFile, "{}: tensor token_embd.weight has shape {}, expected [dim, vocab]",
                 name, shape_text(embd->shape));
  c.vocab_size = static_cast<int>(embd->shape[1]);
  const GgufTensor* output = f.find_tensor("output.weight");
  c.shared_classifier = output == nullptr;
  try {
    c.validate(fmt::format("{}: llama metadata", name));
  } catch (const Error& e) {
    throw Error(Errc::BadFile, e.what());
  }
  if (f.find("llama.rope.dimension_count")) {
    const std::int64_t rd = f.get_int("llama.rope.dimension_count");
    BRIGADE_CHECK(rd == c.head_size(), Errc::BadFile,
                  "{}: metadata key 'llama.rope.dimension_count' = {}, expected the head size {} "
                  "(brigade rotates whole heads; partial RoPE is refused)",
                  name, rd, c.head_size());
  }
  if (f.find("llama.vocab_size")) {
    const std::int64_t v = f.get_int("llama.vocab_size");
    BRIGADE_CHECK(v == c.vocab_size, Errc::BadFile,
                  "{}: metadata key 'llama.vocab_size' = {}, but tensor token_embd.weight has {} "
                  "rows",
                  name, v, c.vocab_size);
  }
  if (f.find("tokenizer.ggml.tokens")) {
    const std::size_t n = f.get_strings("tokenizer.ggml.tokens").size();
    BRIGADE_CHECK(n == static_cast<std::size_t>(c.vocab_size), Errc::BadFile,
                  "{}: metadata key 'tokenizer.ggml.tokens' holds {} tokens, but tensor "
                  "token_embd.weight has {} rows",
                  name, n, c.vocab_size);
  }

  // A block has 9 tensors: a block count the tensor table cannot hold is refused before
  // anything is sized by it.
  if (static_cast<std::uint64_t>(c.n_layers) * kLayerTensors.size() > f.tensors().size())
    detail::fail(Errc::BadFile,
                 "{}: metadata key 'llama.block_count' = {}, but the file holds {} tensors (each "
                 "block has {})",
                 name, c.n_layers, f.tensors().size(), kLayerTensors.size());
  // Every tensor is one brigade uses, of the expected shape.
  std::vector<std::uint8_t> seen(static_cast<std::size_t>(c.n_layers) * kLayerTensors.size(), 0);
  for (const GgufTensor& t : f.tensors()) {
    std::vector<std::int64_t> expected;
    if (t.name == "token_embd.weight" || t.name == "output.weight") {
      expected = {c.dim, c.vocab_size};
    } else if (t.name == "output_norm.weight") {
      expected = {c.dim};
    } else if (t.name.starts_with("blk.")) {
      const std::string_view rest = std::string_view(t.name).substr(4);
      const std::size_t dot = std::min(rest.find('.'), rest.size());
      std::uint64_t layer = 0;
      const auto [end, ec] = std::from_chars(rest.data(), rest.data() + dot, layer);
      const std::string_view tail = dot < rest.size() ? rest.substr(dot + 1) : std::string_view();
      const auto lt = std::find_if(kLayerTensors.begin(), kLayerTensors.end(), [&](const LayerTensor& x) {
        return tail.size() == x.suffix.size() + 7 && tail.starts_with(x.suffix) &&
               tail.ends_with(".weight");
      });
      if (ec != std::errc() || end != rest.data() + dot ||
          rest.substr(0, dot) != std::to_string(layer) || lt == kLayerTensors.end())
        detail::fail(Errc::BadFile,
                     "{}: tensor {} is not one of a llama block's (blk.N.attn_norm, attn_q, "
                     "attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_down, ffn_up .weight)",
                     name, detail::excerpt(t.name, 80));
      if (layer >= static_cast<std::uint64_t>(c.n_layers))
        detail::fail(Errc::BadFile,
                     "{}: tensor {} belongs to block {}, but metadata key 'llama.block_count' = {} "
                     "(blocks 0..{})",
                     name, t.name, layer, c.n_layers, c.n_layers - 1);
      seen[layer * kLayerTensors.size() + static_cast<std::size_t>(lt - kLayerTensors.begin())] = 1;
      expected = layer_shape(lt->suffix, c);
    } else {
      detail::fail(Errc::BadFile,
                   "{}: tensor {} is not one brigade uses for a llama model (a RoPE frequency "
                   "table, for instance, means a RoPE variant brigade does not implement)",
                   name, detail::excerpt(t.name, 80));
    }
    if (t.shape != expected)
      detail::fail(Errc::BadFile, "{}: tensor {} has shape {}, expected {} from the metadata", name,
                   t.name, shape_text(t.shape), shape_text(expected));
  }
  for (std::size_t i = 0; i < seen.size(); ++i)
    if (!seen[i])
      detail::fail(Errc::BadFile,
                   "{}: tensor blk.{}.{}.weight is missing (metadata key 'llama.block_count' = {})",
                   name, i / kLayerTensors.size(), kLayerTensors[i % kLayerTensors.size()].suffix,
                   c.n_layers);
  const GgufTensor* norm = f.find_tensor("output_norm.weight");
  if (!norm) detail::fail(Errc::BadFile, "{}: tensor output_norm.weight is missing", name);

  const bool scan = !options.defer_finite_check;
  w.token_embedding = matrix_data(f, *embd, scan);
  w.rms_final = gain_data(f, *norm, scan);
  w.wcls = output ? matrix_data(f, *output, scan) : w.token_embedding;
  w.layers.assign(static_cast<std::size_t>(c.n_layers), DecoderWeights{});
  for (std::size_t l = 0; l < w.layers.size(); ++l)
    for (const LayerTensor& lt : kLayerTensors) {
      const GgufTensor& t = *f.find_tensor(fmt::format("blk.{}.{}.weight", l, lt.suffix));
      if (lt.gain != nullptr)
        w.layers[l].*lt.gain = gain_data(f, t, scan);
      else
        w.layers[l].*lt.matrix = matrix_data(f, t, scan);
    }
  w.storage = f.storage();
  w.mapped = true;
  if (!scan)
    w.check_finite = [f, c](int first, int last) { check_finite_layers(f, c, first, last); };
  return w;
}

LlamaWeights load_gguf_llama(const std::filesystem::path& path, const LoadOptions& options) {
  return load_gguf_llama(GgufFile::open(path), options);
}

// ---- tokenizer ----------------------------------------------------------------------------

namespace {

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581, SentencePiece's space
constexpr std::string_view kBosPiece = "\n<s>\n", kEosPiece = "\n</s>\n";
// SentencePiece / llama.cpp token types.
constexpr std::int32_t kTypeNormal = 1, kTypeUnknown = 2, kTypeControl = 3, kTypeByte = 6;

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    if (s.substr(i, from.size()) == from) {
      out += to;
      i += from.size();
    } else {
      out += s[i++];
    }
  }
  return out;
}

}  // namespace

Tokenizer load_gguf_tokenizer(const GgufFile& f, int vocab_size) {
  const std::string name = f.path().string();
  const std::string_view model = f.get_string("tokenizer.ggml.model");
  if (model != "llama")
    detail::fail(Errc::BadFile,
                 "{}: metadata key 'tokenizer.ggml.model' = '{}', expected 'llama' (brigade reads "
                 "SentencePiece BPE vocabularies)",
                 name, detail::excerpt(model, 64));
  const auto& tokens = f.get_strings("tokenizer.ggml.tokens");
  std::vector<float> scores = f.find("tokenizer.ggml.scores") ? f.get_floats("tokenizer.ggml.scores")
                                                              : std::vector<float>(tokens.size(), 0.0f);
  BRIGADE_CHECK(scores.size() == tokens.size(), Errc::BadFile,
                "{}: metadata key 'tokenizer.ggml.scores' holds {} scores, expected {} (one per "
                "token)",
                name, scores.size(), tokens.size());
  if (vocab_size > 0)
    BRIGADE_CHECK(tokens.size() == static_cast<std::size_t>(vocab_size), Errc::BadFile,
                  "{}: metadata key 'tokenizer.ggml.tokens' holds {} tokens, expected the model's "
                  "vocab_size = {}",
                  name, tokens.size(), vocab_size);
  if (f.find("tokenizer.ggml.token_type")) {
    const std::vector<std::int64_t> types = f.get_ints("tokenizer.ggml.token_type");
    BRIGADE_CHECK(types.size() == tokens.size(), Errc::BadFile,
                  "{}: metadata key 'tokenizer.ggml.token_type' holds {} types, expected {}", name,
                  types.size(), tokens.size());
  }
  for (const auto& [key, id] : {std::pair{"tokenizer.ggml.bos_token_id", Tokenizer::kBos},
                                std::pair{"tokenizer.ggml.eos_token_id", Tokenizer::kEos}}) {
    if (!f.find(key)) continue;
    const std::int64_t v = f.get_int(key);
    BRIGADE_CHECK(v == id, Errc::BadFile,
                  "{}: metadata key '{}' = {}, expected {} (the Llama SentencePiece layout "
                  "brigade's tokenizer follows)",
                  name, key, v, id);
  }
  // run.c's byte fallback: byte b is id b + 3.
  BRIGADE_CHECK(tokens.size() >= 259, Errc::BadFile,
                "{}: metadata key 'tokenizer.ggml.tokens' holds {} tokens, expected at least 259 "
                "(<unk>, <s>, </s> and the 256 byte tokens)",
                name, tokens.size());
  for (int b = 0; b < 256; ++b) {
    const std::string expected = fmt::format("<0x{:02X}>", b);
    BRIGADE_CHECK(tokens[static_cast<std::size_t>(b + 3)] == expected, Errc::BadFile,
                  "{}: token {} of 'tokenizer.ggml.tokens' is '{}', expected the byte token '{}'",
                  name, b + 3, detail::excerpt(tokens[static_cast<std::size_t>(b + 3)]), expected);
  }
  std::vector<std::string> pieces;
  pieces.reserve(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (static_cast<int>(i) == Tokenizer::kBos)
      pieces.emplace_back(kBosPiece);
    else if (static_cast<int>(i) == Tokenizer::kEos)
      pieces.emplace_back(kEosPiece);
    else
      pieces.push_back(replace_all(tokens[i], kSpaceMark, " "));
  }
  return Tokenizer::from_vocabulary(std::move(pieces), std::move(scores), name);
}

// ---- writer -------------------------------------------------------------------------------

namespace {

/// Builds a GGUF v3 file in memory order: metadata, tensor infos, then the data.
class GgufWriter {
 public:
  void u32(std::string_view key, std::uint32_t v) { scalar(key, GgufValueType::U32, v); }
  void f32(std::string_view key, float v) { scalar(key, GgufValueType::F32, v); }
  void boolean(std::string_view key, bool v) { scalar(key, GgufValueType::Bool, std::uint8_t{v}); }
  void string(std::string_view key, std::string_view v) {
    begin(key, GgufValueType::String);
    str(meta_, v);
    ++n_kv_;
  }
  void strings(std::string_view key, const std::vector<std::string>& v) {
    array_head(key, GgufValueType::String, v.size());
    for (const auto& s : v) str(meta_, s);
  }
  template <typename T>
  void array(std::string_view key, GgufValueType t, const std::vector<T>& v) {
    array_head(key, t, v.size());
    put(meta_, v.data(), v.size() * sizeof(T));
  }
  /// A tensor of `bytes` at `data`, ggml shape `shape` (innermost first).
  void tensor(std::string name, std::vector<std::int64_t> shape, DType dtype, const void* data,
              std::uint64_t bytes) {
    tensors_.push_back({std::move(name), std::move(shape), dtype, data, bytes});
  }

  /// Writes the file atomically.
  void write(const std::filesystem::path& path) const {
    const std::string name = path.string();
    const std::string tmp = name + ".tmp";
    std::FILE* fp = std::fopen(tmp.c_str(), "wb");
    if (!fp)
      detail::fail(Errc::BadFile, "{}: cannot create temporary file {}: {}", name, tmp,
                   errno_text(errno));
    bool ok = true;
    int err = 0;
    std::uint64_t written = 0;
    auto out = [&](const void* p, std::size_t n) {
      if (!ok || n == 0) return;
      if (std::fwrite(p, 1, n, fp) != n) {
        ok = false;
        err = errno;
      }
      written += n;
    };
    static const std::array<char, kAlign> zeros{};
    auto pad = [&] { out(zeros.data(), static_cast<std::size_t>((kAlign - written % kAlign) % kAlign)); };
    std::string head;
    put(head, &kMagic, 4);
    const std::uint32_t version = 3;
    put(head, &version, 4);
    const std::uint64_t nt = tensors_.size();
    put(head, &nt, 8);
    put(head, &n_kv_, 8);
    out(head.data(), head.size());
    out(meta_.data(), meta_.size());
    std::string infos;
    std::uint64_t offset = 0;
    for (const Tensor& t : tensors_) {
      str(infos, t.name);
      const auto nd = static_cast<std::uint32_t>(t.shape.size());
      put(infos, &nd, 4);
      for (const std::int64_t d : t.shape) put(infos, &d, 8);
      const std::uint32_t type = ggml_of_dtype(t.dtype);
      put(infos, &type, 4);
      put(infos, &offset, 8);
      offset += (t.bytes + kAlign - 1) / kAlign * kAlign;
    }
    out(infos.data(), infos.size());
    pad();
    for (const Tensor& t : tensors_) {
      out(t.data, static_cast<std::size_t>(t.bytes));
      pad();
    }
    if (ok && std::fflush(fp) != 0) ok = false, err = errno;
    if (ok && ::fsync(::fileno(fp)) != 0) ok = false, err = errno;
    if (std::fclose(fp) != 0 && ok) ok = false, err = errno;
    std::error_code ec;
    if (!ok) {
      std::filesystem::remove(tmp, ec);
      detail::fail(Errc::BadFile, "{}: writing {} failed: {}", name, tmp, errno_text(err));
    }
    std::filesystem::rename(tmp, path, ec);
    if (ec) {
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      detail::fail(Errc::BadFile, "{}: cannot rename {} to {}: {}", name, tmp, name, ec.message());
    }
  }

  static constexpr std::uint64_t kAlign = GgufFile::kDefaultAlignment;

 private:
  struct Tensor {
    std::string name;
    std::vector<std::int64_t> shape;
    DType dtype;
    const void* data;
    std::uint64_t bytes;
  };
  static void put(std::string& s, const void* p, std::size_t n) {
    s.append(static_cast<const char*>(p), n);
  }
  static void str(std::string& s, std::string_view v) {
    const std::uint64_t n = v.size();
    put(s, &n, 8);
    s.append(v);
  }
  void begin(std::string_view key, GgufValueType t) {
    str(meta_, key);
    const auto type = static_cast<std::uint32_t>(t);
    put(meta_, &type, 4);
  }
  template <typename T>
  void scalar(std::string_view key, GgufValueType t, T v) {
    begin(key, t);
    put(meta_, &v, sizeof v);
    ++n_kv_;
  }
  void array_head(std::string_view key, GgufValueType t, std::uint64_t n) {
    begin(key, GgufValueType::Array);
    const auto et = static_cast<std::uint32_t>(t);
    put(meta_, &et, 4);
    put(meta_, &n, 8);
    ++n_kv_;
  }

  std::string meta_;
  std::uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace

void save_gguf_llama(const std::filesystem::path& path, const LlamaWeights& w,
                     const Tokenizer& tok) {
  const std::string name = path.string();
  const LlamaConfig& c = w.config;
  check_complete(w, fmt::format("save_gguf_llama({})", name));
  BRIGADE_CHECK(tok.vocab_size() == c.vocab_size, Errc::InvalidArgument,
                "save_gguf_llama({}): the tokenizer has {} tokens, the model's vocab_size is {}",
                name, tok.vocab_size(), c.vocab_size);

  GgufWriter g;
  g.string("general.architecture", "llama");
  g.string("general.name", path.stem().string());
  g.u32("general.alignment", static_cast<std::uint32_t>(GgufWriter::kAlign));
  g.u32("llama.context_length", static_cast<std::uint32_t>(c.seq_len));
  g.u32("llama.embedding_length", static_cast<std::uint32_t>(c.dim));
  g.u32("llama.feed_forward_length", static_cast<std::uint32_t>(c.hidden_dim));
  g.u32("llama.block_count", static_cast<std::uint32_t>(c.n_layers));
  g.u32("llama.attention.head_count", static_cast<std::uint32_t>(c.n_heads));
  g.u32("llama.attention.head_count_kv", static_cast<std::uint32_t>(c.n_kv_heads));
  g.u32("llama.rope.dimension_count", static_cast<std::uint32_t>(c.head_size()));
  g.f32("llama.rope.freq_base", c.rope_theta);
  g.f32("llama.attention.layer_norm_rms_epsilon", c.norm_eps);
  g.u32("llama.vocab_size", static_cast<std::uint32_t>(c.vocab_size));
  // The tokenizer in SentencePiece form (the inverse of load_gguf_tokenizer).
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<std::int32_t> types;
  for (int i = 0; i < tok.vocab_size(); ++i) {
    const std::string_view p = tok.piece(i);
    const bool byte = i >= 3 && i < 259 && p.size() == 6 && p.starts_with("<0x") && p.ends_with(">");
    if (i == Tokenizer::kBos)
      tokens.emplace_back("<s>");
    else if (i == Tokenizer::kEos)
      tokens.emplace_back("</s>");
    else
      tokens.push_back(replace_all(p, " ", kSpaceMark));
    scores.push_back(tok.score(i));
    types.push_back(i == Tokenizer::kUnk                          ? kTypeUnknown
                    : i == Tokenizer::kBos || i == Tokenizer::kEos ? kTypeControl
                    : byte                                        ? kTypeByte
                                                                  : kTypeNormal);
  }
  g.string("tokenizer.ggml.model", "llama");
  g.strings("tokenizer.ggml.tokens", tokens);
  g.array("tokenizer.ggml.scores", GgufValueType::F32, scores);
  g.array("tokenizer.ggml.token_type", GgufValueType::I32, types);
  g.u32("tokenizer.ggml.unknown_token_id", Tokenizer::kUnk);
  g.u32("tokenizer.ggml.bos_token_id", Tokenizer::kBos);
  g.u32("tokenizer.ggml.eos_token_id", Tokenizer::kEos);
  g.boolean("tokenizer.ggml.add_bos_token", true);
  g.boolean("tokenizer.ggml.add_eos_token", false);

  // Matrices in the dtype `w` holds them (llama.cpp's layouts: F16/BF16 16-bit values, Q8_0
  // blocks of 34 bytes), the gains float32.
  const std::int64_t d = c.dim, v = c.vocab_size;
  auto matrix = [&](std::string tname, std::vector<std::int64_t> shape, WeightMatrix m) {
    BRIGADE_CHECK(is_weight_dtype(m.dtype), Errc::InvalidArgument,
                  "save_gguf_llama({}): tensor {} is {}, expected f32, f16, bf16 or q8_0", name,
                  tname, to_string(m.dtype));
    const auto bytes = static_cast<std::uint64_t>(weight_row_bytes(m.dtype, shape[0])) *
                       static_cast<std::uint64_t>(shape[1]);
    g.tensor(std::move(tname), std::move(shape), m.dtype, m.data, bytes);
  };
  auto gain = [&](std::string tname, const float* p) {
    g.tensor(std::move(tname), {d}, DType::F32, p, static_cast<std::uint64_t>(d) * sizeof(float));
  };
  matrix("token_embd.weight", {d, v}, w.token_embedding);
  for (std::size_t l = 0; l < w.layers.size(); ++l)
    for (const LayerTensor& lt : kLayerTensors) {
      const std::string tname = fmt::format("blk.{}.{}.weight", l, lt.suffix);
      if (lt.gain != nullptr)
        gain(tname, w.layers[l].*lt.gain);
      else
        matrix(tname, layer_shape(lt.suffix, c), w.layers[l].*lt.matrix);
    }
  gain("output_norm.weight", w.rms_final);
  if (!c.shared_classifier) matrix("output.weight", {d, v}, w.wcls);
  g.write(path);
}

}  // namespace v0
}  // namespace brigade::model
