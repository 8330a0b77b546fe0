// llama2.c legacy checkpoints: mmap'd loading, atomic saving, and seeded synthetic weights.
//
// The file is a 28-byte header (7 little-endian int32) followed by float32 tensors with no
// padding; docs/formats.md describes it. One Layout (offsets in floats from the end of the
// header) serves the loader, the writer and the synthetic generator, so the three agree.
#include "brigade/model/weights.hpp"

#include "brigade/core/error.hpp"
#include "brigade/core/finite.hpp"
#include "brigade/io/input.hpp"

#include "mapped_file.hpp"

#include <Eigen/Core>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <string_view>
#include <vector>

namespace brigade::model {
inline namespace v0 {
namespace {

static_assert(std::endian::native == std::endian::little,
              "brigade reads llama2.c checkpoints in place, which needs a little-endian host");
static_assert(sizeof(float) == 4 && std::numeric_limits<float>::is_iec559,
              "llama2.c checkpoints hold IEEE-754 float32 values");

constexpr std::size_t kHeaderBytes = 7 * sizeof(std::int32_t);
constexpr std::array<const char*, 7> kHeaderFields = {
    "dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};

/// Offsets (in floats, from the first float after the header) of every tensor, and the total.
struct Layout {
  std::uint64_t token_embedding = 0, rms_att = 0, wq = 0, wk = 0, wv = 0, wo = 0, rms_ffn = 0,
                w1 = 0, w2 = 0, w3 = 0, rms_final = 0, freq_real = 0, freq_imag = 0, wcls = 0;
  std::uint64_t total = 0;  ///< floats after the header
  /// Per-layer sizes (floats) of the stacked tensors.
  std::uint64_t dim = 0, qo = 0, kv = 0, ffn = 0;
  std::uint64_t freq = 0;  ///< floats of one RoPE table (seq_len x head_size/2)
  std::uint64_t cls = 0;   ///< floats of the embedding / classifier (vocab x dim)

  /// Bytes of the whole file.
  [[nodiscard]] std::uint64_t file_bytes() const { return kHeaderBytes + 4 * total; }
};

/// Overflow-checked a * b.
bool mul(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  return !__builtin_mul_overflow(a, b, &out);
}
bool add(std::uint64_t& acc, std::uint64_t n) { return !__builtin_add_overflow(acc, n, &acc); }

/// The checkpoint layout for a config whose fields are already positive and consistent;
/// std::nullopt if the sizes do not fit in 64 bits (bytes).
std::optional<Layout> compute_layout(const LlamaConfig& c) {
  Layout l;
  const auto d = static_cast<std::uint64_t>(c.dim), h = static_cast<std::uint64_t>(c.hidden_dim),
             n = static_cast<std::uint64_t>(c.n_layers), v = static_cast<std::uint64_t>(c.vocab_size),
             s = static_cast<std::uint64_t>(c.seq_len), kvd = static_cast<std::uint64_t>(c.kv_dim()),
             hs = static_cast<std::uint64_t>(c.head_size());
  l.dim = d;
  bool ok = mul(d, d, l.qo) && mul(kvd, d, l.kv) && mul(h, d, l.ffn) && mul(s, hs / 2, l.freq) &&
            mul(v, d, l.cls);
  if (!ok) return std::nullopt;
  std::uint64_t at = 0;
  // Reserves `count` tensors of `each` floats at `at`, returns the offset.
  auto take = [&](std::uint64_t& offset, std::uint64_t count, std::uint64_t each) {
    std::uint64_t sz = 0;
    offset = at;
    ok = ok && mul(count, each, sz) && add(at, sz);
  };
  take(l.token_embedding, 1, l.cls);
  take(l.rms_att, n, d);
  take(l.wq, n, l.qo);
  take(l.wk, n, l.kv);
  take(l.wv, n, l.kv);
  take(l.wo, n, l.qo);
  take(l.rms_ffn, n, d);
  take(l.w1, n, l.ffn);
  take(l.w2, n, l.ffn);
  take(l.w3, n, l.ffn);
  take(l.rms_final, 1, d);
  take(l.freq_real, 1, l.freq);
  take(l.freq_imag, 1, l.freq);
  if (c.shared_classifier)
    l.wcls = l.token_embedding;
  else
    take(l.wcls, 1, l.cls);
  l.total = at;
  std::uint64_t bytes = 0;
  if (!ok || !mul(at, 4, bytes) || !add(bytes, kHeaderBytes)) return std::nullopt;
  return l;
}

/// Points `w`'s tensors into `base` (the first float after the header) following `l`.
void bind(LlamaWeights& w, const float* base, const Layout& l) {
  w.token_embedding = base + l.token_embedding;
  w.layers.assign(static_cast<std::size_t>(w.config.n_layers), DecoderWeights{});
  for (std::size_t i = 0; i < w.layers.size(); ++i) {
    DecoderWeights& x = w.layers[i];
    x.rms_att = base + l.rms_att + i * l.dim;
    x.wq = base + l.wq + i * l.qo;
    x.wk = base + l.wk + i * l.kv;
    x.wv = base + l.wv + i * l.kv;
    x.wo = base + l.wo + i * l.qo;
    x.rms_ffn = base + l.rms_ffn + i * l.dim;
    x.w1 = base + l.w1 + i * l.ffn;
    x.w2 = base + l.w2 + i * l.ffn;
    x.w3 = base + l.w3 + i * l.ffn;
  }
  w.rms_final = base + l.rms_final;
  w.wcls = base + l.wcls;
}

/// Fills the two RoPE tables as llama2.c's export does (model.py, precompute_freqs_cis, in
/// float32): freq_i = 1 / theta^(2i / head_size), angle = float(pos) * freq_i, then cos and sin.
/// The angle and frequency are rounded to float as PyTorch computes them; cos/sin are taken in
/// double and rounded, which is within 1 ulp of PyTorch's own float32 cos/sin.
void fill_rope_tables(const LlamaConfig& c, float* real, float* imag) {
  const int half = c.head_size() / 2;
  std::vector<float> freq(static_cast<std::size_t>(half));
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_size());
    freq[static_cast<std::size_t>(i)] = 1.0f / std::pow(c.rope_theta, exponent);
  }
  std::size_t k = 0;
  for (int pos = 0; pos < c.seq_len; ++pos) {
    for (int i = 0; i < half; ++i, ++k) {
      const float angle = static_cast<float>(pos) * freq[static_cast<std::size_t>(i)];
      real[k] = static_cast<float>(std::cos(static_cast<double>(angle)));
      imag[k] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
}

std::string errno_text(int e) { return std::generic_category().message(e); }

/// Throws if a weight of ModelSpec layers [first, last) of `w` is NaN or infinite, naming the
/// tensor, the decoder layer and the element (flat index, and row/column for a matrix).
void check_finite_weights(const LlamaWeights& w, const Layout& l, std::string_view where,
                          Errc errc, int first, int last) {
  const LlamaConfig& c = w.config;
  const auto d = static_cast<std::uint64_t>(c.dim);
  auto check = [&](WeightMatrix m, std::uint64_t n, std::uint64_t cols, std::string_view tensor,
                   int layer) {
    const float* p = m.f32();  // llama2.c files (and files to write) are float32
    const std::uint64_t i = first_non_finite(p, static_cast<std::size_t>(n));
    if (i == n) return;
    const std::string at =
        layer >= 0 ? fmt::format("tensor {} of decoder layer {} (layers count from 0)", tensor, layer)
                   : fmt::format("tensor {}", tensor);
    const std::string elem = cols == n ? fmt::format("element {}", i)
                                       : fmt::format("element {} (row {}, column {})", i,
                                                     i / cols, i % cols);
    detail::fail(errc, "{}: {}, {} is {}: a checkpoint's weights must be finite", where,
                 at, elem, p[i]);
  };
  const int L = c.n_layers;
  for (int s = std::max(first, 0); s < std::min(last, ModelSpec::decoder_layer(L) + 2); ++s) {
    if (s == 0) {
      check(w.token_embedding, l.cls, d, "token_embedding", -1);
    } else if (s <= L) {
      const int li = s - 1;
      const DecoderWeights& x = w.layers[static_cast<std::size_t>(li)];
      check(x.rms_att, l.dim, l.dim, "rms_att", li);
      check(x.wq, l.qo, d, "wq", li);
      check(x.wk, l.kv, d, "wk", li);
      check(x.wv, l.kv, d, "wv", li);
      check(x.wo, l.qo, d, "wo", li);
      check(x.rms_ffn, l.dim, l.dim, "rms_ffn", li);
      check(x.w1, l.ffn, d, "w1", li);
      check(x.w2, l.ffn, static_cast<std::uint64_t>(c.hidden_dim), "w2", li);
      check(x.w3, l.ffn, d, "w3", li);
    } else if (s == L + 1) {
      check(w.rms_final, l.dim, l.dim, "rms_final", -1);
    } else if (!c.shared_classifier) {  // the LM head
      check(w.wcls, l.cls, d, "wcls", -1);
    } else if (first > 0) {  // a shared classifier is the embedding table, scanned here too
      check(w.token_embedding, l.cls, d, "token_embedding", -1);
    }
  }
}

/// check_finite_weights over every layer.
void check_finite_weights(const LlamaWeights& w, const Layout& l, std::string_view where,
                          Errc errc) {
  check_finite_weights(w, l, where, errc, 0, ModelSpec::decoder_layer(w.config.n_layers) + 3);
}

/// Owns a read-only mapping and its file descriptor.
struct Mapping {
  void* addr = MAP_FAILED;
  std::size_t length = 0;
  int fd = -1;
};

// ---- counter-based normal numbers for synthetic weights ----------------------------------

/// SplitMix64's output function: a strong 64-bit mix, used as a counter-based generator.
constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

/// One contiguous range of a tensor to fill with N(0, stddev^2): element j of the tensor is the
/// (j % 2)-th Box-Muller output of counter j / 2 of stream `key`, so any split of the range
/// gives the same numbers.
struct NormalJob {
  float* tensor = nullptr;    ///< first element of the whole tensor
  std::uint64_t begin = 0;    ///< first element of this range
  std::uint64_t end = 0;      ///< one past the last element of this range
  std::uint64_t key = 0;      ///< stream of this tensor
  float stddev = 0.0f;
};

/// ln(u) for u in [2^-24, 1], within about 1e-7 relative: the exponent, plus an atanh series
/// for the mantissa folded into [sqrt(1/2), sqrt(2)). Plain float arithmetic, so loops over
/// it vectorize and the result does not depend on the C library.
inline float log_unit(float u) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(u);
  int e = static_cast<int>(bits >> 23) - 127;
  float m = std::bit_cast<float>((bits & 0x7FFFFFu) | 0x3F800000u);  // [1, 2)
  const bool fold = m > 1.41421356f;
  m = fold ? m * 0.5f : m;
  e = fold ? e + 1 : e;
  const float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;  // |t| <= 0.172
  const float series =
      t * (2.0f + t2 * (2.0f / 3.0f + t2 * (2.0f / 5.0f + t2 * (2.0f / 7.0f + t2 * (2.0f / 9.0f)))));
  return static_cast<float>(e) * 0.693147180559945f + series;
}

/// cos and sin of 2*pi*x for x in [0, 1), within about 1e-7: quadrant reduction to
/// [-pi/4, pi/4] and Taylor polynomials (plain float arithmetic, vectorizable).
inline void sincos_turns(float x, float& c, float& s) noexcept {
  const int q = static_cast<int>(4.0f * x + 0.5f);  // nearest quarter turn, 0..4
  const float a = 6.28318530717958647692f * (x - 0.25f * static_cast<float>(q));
  const float a2 = a * a;
  const float sa =
      a * (1.0f - a2 / 6.0f * (1.0f - a2 / 20.0f * (1.0f - a2 / 42.0f * (1.0f - a2 / 72.0f))));
  const float ca =
      1.0f - a2 / 2.0f * (1.0f - a2 / 12.0f * (1.0f - a2 / 30.0f * (1.0f - a2 / 56.0f)));
  const bool swap = (q & 1) != 0;
  const float cc = swap ? sa : ca, ss = swap ? ca : sa;
  c = ((q + 1) & 2) != 0 ? -cc : cc;  // quadrants 1 and 2
  s = (q & 2) != 0 ? -ss : ss;        // quadrants 2 and 3
}

/// Fills elements [begin, end) of one tensor. Pair p = (element 2p, element 2p+1) is the
/// Box-Muller transform of the 64 bits mix64(key ^ p * odd): 24 bits for the radius, 24 for
/// the angle. Work goes in blocks of pairs so that each stage is a simple, vectorizable loop.
void run_normal_job(const NormalJob& job) {
  constexpr std::size_t kBlock = 256;  // pairs per block
  constexpr float kInv24 = 1.0f / 16777216.0f;  // 2^-24
  alignas(64) float u1[kBlock], u2[kBlock], z0[kBlock], z1[kBlock];
  const std::uint64_t first_pair = job.begin / 2, end_pair = (job.end + 1) / 2;
  for (std::uint64_t p0 = first_pair; p0 < end_pair; p0 += kBlock) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(kBlock, end_pair - p0));
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t bits = mix64(job.key ^ ((p0 + i) * 0xD1B54A32D192ED03ULL));
      u1[i] = static_cast<float>(static_cast<std::int32_t>(bits >> 40) + 1) * kInv24;  // (0, 1]
      u2[i] = static_cast<float>(static_cast<std::int32_t>(bits & 0xFFFFFFULL)) * kInv24;  // [0, 1)
    }
    for (std::size_t i = 0; i < n; ++i) u1[i] = std::max(0.0f, -2.0f * log_unit(u1[i]));
    // Eigen's sqrt is the IEEE one in SIMD registers; std::sqrt in a loop would not vectorize
    // because of errno.
    Eigen::Map<Eigen::ArrayXf> radius(u1, static_cast<Eigen::Index>(n));
    radius = radius.sqrt() * job.stddev;
    for (std::size_t i = 0; i < n; ++i) {
      float c = 0.0f, s = 0.0f;
      sincos_turns(u2[i], c, s);
      z0[i] = u1[i] * c;
      z1[i] = u1[i] * s;
    }
    // Interleave into the tensor, keeping only elements inside [begin, end).
    const std::uint64_t lo = std::max(job.begin, 2 * p0), hi = std::min(job.end, 2 * (p0 + n));
    for (std::uint64_t j = lo; j < hi; ++j) {
      const auto i = static_cast<std::size_t>(j / 2 - p0);
      job.tensor[j] = (j % 2 == 0) ? z0[i] : z1[i];
    }
  }
}

/// Runs the jobs on up to hardware_concurrency() threads (the result does not depend on it).
void run_normal_jobs(const std::vector<NormalJob>& jobs) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const auto workers = static_cast<unsigned>(std::min<std::size_t>(hw, jobs.size()));
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t i = next++; i < jobs.size(); i = next++) run_normal_job(jobs[i]);
  };
  if (workers <= 1) {
    worker();
    return;
  }
  std::vector<std::jthread> pool;
  pool.reserve(workers - 1);
  for (unsigned t = 1; t < workers; ++t) pool.emplace_back(worker);
  worker();
}

}  // namespace

namespace {

/// The config a llama2.c header's 7 fields give (vocab_size < 0: a separate classifier).
LlamaConfig config_from_header(const std::array<std::int32_t, 7>& h) {
  LlamaConfig c;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.vocab_size = h[5] < 0 ? -h[5] : h[5];
  c.shared_classifier = h[5] > 0;
  c.seq_len = h[6];
  return c;
}

/// True when the file walks exactly as a llama2.c tokenizer: a uint32 max_token_length, then
/// (float32 score, int32 length in [0, max_token_length], that many bytes) records that end at
/// the end of the file. Read only after a checkpoint header failed, to name a swapped file.
bool looks_like_llama2c_tokenizer(int fd, std::uint64_t size) {
  if (size < 4 || size > io::kMaxTokenizerFileBytes) return false;
  std::string bytes(static_cast<std::size_t>(size), '\0');
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t r = ::pread(fd, bytes.data() + got, bytes.size() - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    got += static_cast<std::size_t>(r);
  }
  std::uint32_t max_len = 0;
  std::memcpy(&max_len, bytes.data(), 4);
  std::size_t at = 4, records = 0;
  while (bytes.size() - at >= 8) {
    std::int32_t len = 0;
    std::memcpy(&len, bytes.data() + at + 4, 4);
    if (len < 0 || static_cast<std::uint32_t>(len) > max_len) return false;
    at += 8;
    if (bytes.size() - at < static_cast<std::size_t>(len)) return false;
    at += static_cast<std::size_t>(len);
    ++records;
  }
  return at == bytes.size() && records > 0;
}

}  // namespace

bool is_llama2c_checkpoint(const std::filesystem::path& path) {
  const std::string head = io::read_head(path, kHeaderBytes);
  if (head.size() != kHeaderBytes) return false;
  std::array<std::int32_t, 7> h{};
  std::memcpy(h.data(), head.data(), kHeaderBytes);
  if (h[5] == 0 || h[5] == std::numeric_limits<std::int32_t>::min()) return false;
  for (std::size_t i = 0; i < h.size(); ++i)
    if (i != 5 && h[i] <= 0) return false;
  LlamaConfig c = config_from_header(h);
  try {
    c.validate("is_llama2c_checkpoint");
  } catch (const Error&) {
    return false;
  }
  const std::optional<Layout> layout = compute_layout(c);
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  return layout && !ec && size == layout->file_bytes();
}

LlamaWeights load_llama2c_checkpoint(const std::filesystem::path& path,
                                     const LoadOptions& options) {
  detail::OpenFile file = detail::open_file(path, "llama2.c checkpoint");
  const std::string& name = file.name();
  const int fd = file.fd();
  const std::uint64_t size = file.size();
  if (const auto other = io::foreign_format(io::read_head(path, 16)))
    detail::fail(Errc::BadFile,
                 "{}: is {}, not a llama2.c checkpoint (brigade reads llama2.c .bin checkpoints; "
                 "llama2.c's export.py writes them)",
                 name, *other);
  if (size < kHeaderBytes)
    detail::fail(Errc::BadFile,
                 "{}: file is {} bytes, shorter than the {}-byte llama2.c header (7 int32: dim, "
                 "hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len)",
                 name, size, kHeaderBytes);

  std::array<std::int32_t, 7> h{};
  std::size_t got = 0;
  while (got < kHeaderBytes) {
    const ssize_t r = ::pread(fd, reinterpret_cast<char*>(h.data()) + got, kHeaderBytes - got,
                              static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      detail::fail(Errc::BadFile, "{}: cannot read the {}-byte header: {}", name, kHeaderBytes,
                   r < 0 ? errno_text(errno) : std::string("unexpected end of file"));
    got += static_cast<std::size_t>(r);
  }

  LlamaWeights w;
  LlamaConfig& c = w.config;
  try {
    for (std::size_t i = 0; i < h.size(); ++i) {
      if (i == 5) {
        BRIGADE_CHECK(h[i] != 0 && h[i] != std::numeric_limits<std::int32_t>::min(), Errc::BadFile,
                      "{}: header field vocab_size = {}, expected != 0 and > {} (a negative value "
                      "means a separate classifier)",
                      name, h[i], std::numeric_limits<std::int32_t>::min());
      } else {
        BRIGADE_CHECK(h[i] > 0, Errc::BadFile, "{}: header field {} = {}, expected > 0", name,
                      kHeaderFields[i], h[i]);
      }
    }
    c = config_from_header(h);
    c.validate(fmt::format("{}: llama2.c header", name));
  } catch (const Error& e) {
    if (looks_like_llama2c_tokenizer(fd, size))
      detail::fail(Errc::BadFile,
                   "{}: is a llama2.c tokenizer, not a model checkpoint (were --model and "
                   "--tokenizer swapped?)",
                   name);
    throw Error(Errc::BadFile, e.what());
  }

  const std::optional<Layout> layout = compute_layout(c);
  const std::string header_text = fmt::format(
      "dim={} hidden_dim={} n_layers={} n_heads={} n_kv_heads={} vocab_size={} seq_len={}", h[0],
      h[1], h[2], h[3], h[4], h[5], h[6]);
  if (!layout)
    detail::fail(Errc::BadFile, "{}: header ({}) implies more than 2^64 bytes; file is {} bytes",
                 name, header_text, size);
  const std::uint64_t expected = layout->file_bytes();
  if (size != expected) {
    std::string hint;
    if (c.shared_classifier && size == expected + 4 * layout->cls)
      hint = "; the extra bytes are exactly one vocab x dim classifier, so vocab_size should "
             "probably be negative";
    else if (!c.shared_classifier && size + 4 * layout->cls == expected)
      hint = "; the file lacks exactly one vocab x dim classifier, so vocab_size should probably "
             "be positive (shared)";
    detail::fail(Errc::BadFile,
                 "{}: file size is {} bytes, expected {} bytes from the header ({}): {} + 4 x {} "
                 "float32{}",
                 name, size, expected, header_text, kHeaderBytes, layout->total, hint);
  }
  const detail::MappedFile m = file.map();
  w.storage = m.mapping;
  w.mapped = true;
  const auto* base = reinterpret_cast<const float*>(m.bytes + kHeaderBytes);
  bind(w, base, *layout);
  if (!options.defer_finite_check) {
    check_finite_weights(w, *layout, name, Errc::BadFile);
    return w;
  }
  // The scan of a stage's layers when it first uses them (the views share the mapping).
  w.check_finite = [view = w, l = *layout, name](int first, int last) {
    check_finite_weights(view, l, name, Errc::BadFile, first, last);
  };
  return w;
}

void check_complete(const LlamaWeights& w, std::string_view what) {
  const LlamaConfig& c = w.config;
  c.validate(what);
  BRIGADE_CHECK(w.layers.size() == static_cast<std::size_t>(c.n_layers), Errc::InvalidArgument,
                "{}: {} layers of weights, expected n_layers = {}", what, w.layers.size(),
                c.n_layers);
  BRIGADE_CHECK(w.token_embedding && w.rms_final && (c.shared_classifier || w.wcls),
                Errc::InvalidArgument, "{}: token_embedding, rms_final or wcls is null", what);
  for (std::size_t i = 0; i < w.layers.size(); ++i) {
    const DecoderWeights& x = w.layers[i];
    const std::array<std::pair<std::string_view, bool>, 9> tensors = {{
        {"rms_att", x.rms_att != nullptr}, {"wq", static_cast<bool>(x.wq)},
        {"wk", static_cast<bool>(x.wk)}, {"wv", static_cast<bool>(x.wv)},
        {"wo", static_cast<bool>(x.wo)}, {"rms_ffn", x.rms_ffn != nullptr},
        {"w1", static_cast<bool>(x.w1)}, {"w2", static_cast<bool>(x.w2)},
        {"w3", static_cast<bool>(x.w3)}}};
    for (const auto& [tensor, set] : tensors)
      BRIGADE_CHECK(set, Errc::InvalidArgument, "{}: layer {} tensor {} is null", what, i, tensor);
  }
}

void save_llama2c_checkpoint(const std::filesystem::path& path, const LlamaWeights& w) {
  const std::string name = path.string();
  const LlamaConfig& c = w.config;
  check_complete(w, fmt::format("save_llama2c_checkpoint({})", name));
  require_f32(w, fmt::format("save_llama2c_checkpoint({})", name).c_str());
  const std::optional<Layout> layout = compute_layout(c);
  BRIGADE_CHECK(layout.has_value(), Errc::InvalidArgument,
                "save_llama2c_checkpoint({}): the config's size overflows 64 bits", name);

  check_finite_weights(w, *layout, fmt::format("save_llama2c_checkpoint({})", name),
                       Errc::InvalidArgument);

  std::vector<float> real(layout->freq), imag(layout->freq);
  fill_rope_tables(c, real.data(), imag.data());

  const std::string tmp = name + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f)
    detail::fail(Errc::BadFile, "{}: cannot create temporary file {}: {}", name, tmp,
                 errno_text(errno));
  bool ok = true;
  int err = 0;
  auto put = [&](const void* data, std::size_t bytes) {
    if (!ok || bytes == 0) return;
    if (std::fwrite(data, 1, bytes, f) != bytes) {
      ok = false;
      err = errno;
    }
  };
  auto put_floats = [&](WeightMatrix m, std::uint64_t n) {
    put(m.f32(), static_cast<std::size_t>(n) * sizeof(float));
  };
  const std::array<std::int32_t, 7> header = {
      c.dim,      c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
      c.shared_classifier ? c.vocab_size : -c.vocab_size, c.seq_len};
  put(header.data(), kHeaderBytes);
  put_floats(w.token_embedding, layout->cls);
  auto per_layer = [&](auto DecoderWeights::*member, std::uint64_t n) {
    for (const DecoderWeights& x : w.layers) put_floats(x.*member, n);
  };
  per_layer(&DecoderWeights::rms_att, layout->dim);
  per_layer(&DecoderWeights::wq, layout->qo);
  per_layer(&DecoderWeights::wk, layout->kv);
  per_layer(&DecoderWeights::wv, layout->kv);
  per_layer(&DecoderWeights::wo, layout->qo);
  per_layer(&DecoderWeights::rms_ffn, layout->dim);
  per_layer(&DecoderWeights::w1, layout->ffn);
  per_layer(&DecoderWeights::w2, layout->ffn);
  per_layer(&DecoderWeights::w3, layout->ffn);
  put_floats(w.rms_final, layout->dim);
  put_floats(real.data(), layout->freq);
  put_floats(imag.data(), layout->freq);
  if (!c.shared_classifier) put_floats(w.wcls, layout->cls);
  if (ok && std::fflush(f) != 0) {
    ok = false;
    err = errno;
  }
  if (ok && ::fsync(::fileno(f)) != 0) {
    ok = false;
    err = errno;
  }
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  std::error_code ec;
  if (!ok) {
    std::filesystem::remove(tmp, ec);
    detail::fail(Errc::BadFile, "{}: writing {} bytes to {} failed: {}", name,
                 layout->file_bytes(), tmp, errno_text(err));
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    detail::fail(Errc::BadFile, "{}: cannot rename {} to {}: {}", name, tmp, name, ec.message());
  }
}

LlamaWeights make_synthetic_weights(const LlamaConfig& config, std::uint64_t seed) {
  config.validate("make_synthetic_weights");
  const std::optional<Layout> layout = compute_layout(config);
  BRIGADE_CHECK(layout && layout->total <= std::numeric_limits<std::size_t>::max() / 4,
                Errc::InvalidArgument,
                "make_synthetic_weights: the config's size overflows this process's address "
                "space (dim={}, n_layers={}, vocab_size={})",
                config.dim, config.n_layers, config.vocab_size);
  const Layout& l = *layout;
  std::shared_ptr<float[]> buffer(new float[static_cast<std::size_t>(l.total)]);
  float* base = buffer.get();

  // Gains are 1; the RoPE tables are those save_llama2c_checkpoint writes.
  std::fill(base + l.rms_att, base + l.rms_att + l.dim * static_cast<std::uint64_t>(config.n_layers),
            1.0f);
  std::fill(base + l.rms_ffn, base + l.rms_ffn + l.dim * static_cast<std::uint64_t>(config.n_layers),
            1.0f);
  std::fill(base + l.rms_final, base + l.rms_final + l.dim, 1.0f);
  fill_rope_tables(config, base + l.freq_real, base + l.freq_imag);

  // Random tensors: each gets its own stream (seed, tensor number), split into chunks.
  constexpr float kStd = 0.02f;
  const float out_std = kStd / std::sqrt(2.0f * static_cast<float>(config.n_layers));
  const auto layers = static_cast<std::uint64_t>(config.n_layers);
  struct RandomTensor {
    std::uint64_t offset, count;
    float stddev;
  };
  std::vector<RandomTensor> tensors = {
      {l.token_embedding, l.cls, kStd}, {l.wq, layers * l.qo, kStd},
      {l.wk, layers * l.kv, kStd},      {l.wv, layers * l.kv, kStd},
      {l.wo, layers * l.qo, out_std},   {l.w1, layers * l.ffn, kStd},
      {l.w2, layers * l.ffn, out_std},  {l.w3, layers * l.ffn, kStd},
  };
  if (!config.shared_classifier) tensors.push_back({l.wcls, l.cls, kStd});
  constexpr std::uint64_t kChunk = std::uint64_t{1} << 20;  // even, so pairs never straddle
  std::vector<NormalJob> jobs;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const std::uint64_t key = mix64(mix64(seed) + t);
    for (std::uint64_t b = 0; b < tensors[t].count; b += kChunk)
      jobs.push_back({base + tensors[t].offset, b, std::min(tensors[t].count, b + kChunk), key,
                      tensors[t].stddev});
  }
  run_normal_jobs(jobs);

  LlamaWeights w;
  w.config = config;
  bind(w, base, l);
  w.storage = std::shared_ptr<const void>(buffer, buffer.get());
  return w;
}

}  // namespace v0
}  // namespace brigade::model
