// llama2.c's tokenizer: the tokenizer.bin reader and run.c's encode/decode/safe_printf
// semantics, written against a hash map from piece to id.
#include "brigade/model/tokenizer.hpp"

#include "brigade/core/error.hpp"
#include "brigade/io/input.hpp"
#include "brigade/io/trace.hpp"
#include "brigade/model/weights.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <queue>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace brigade::model {
inline namespace v0 {
namespace {

static_assert(std::endian::native == std::endian::little,
              "llama2.c tokenizer files are little-endian");

/// Transparent hash so lookups by string_view do not allocate.
struct PieceHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept {
    return std::hash<std::string_view>{}(s);
  }
};

/// run.c's starting best score: a merge whose score is not above it never happens.
constexpr float kNoMergeScore = -1e10f;

/// Value of one hex digit, or -1.
int hex_value(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

/// isprint / isspace of the "C" locale (what run.c sees: it never calls setlocale).
bool printable_or_space(unsigned char b) noexcept {
  return (b >= 0x20 && b <= 0x7E) || b == '\t' || b == '\n' || b == '\v' || b == '\f' ||
         b == '\r';
}

}  // namespace

struct Tokenizer::Impl {
  std::vector<std::string> pieces;
  std::vector<float> scores;
  int max_token_length = 0;
  /// piece -> id (pieces are unique: index() refuses a vocabulary that repeats one).
  std::unordered_map<std::string, int, PieceHash, std::equal_to<>> ids;

  /// Builds `ids`. `where` names the vocabulary in the error.
  /// @throws brigade::Error{BadFile} naming the piece and both ids when two ids hold one piece
  void index(std::string_view where) {
    ids.clear();
    ids.reserve(pieces.size());
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      const auto [it, fresh] = ids.emplace(pieces[i], static_cast<int>(i));
      if (!fresh)
        detail::fail(Errc::BadFile,
                     "{}: tokens {} and {} hold the same piece '{}' ({} bytes); each piece must "
                     "have one id, or encoding is ambiguous (tokenizer.bin files exported before "
                     "llama2.c kept byte tokens as \"<0xXX>\" repeat pieces this way)",
                     where, it->second, i, detail::excerpt(pieces[i]), pieces[i].size());
    }
  }

  [[nodiscard]] int lookup(std::string_view s) const {
    const auto it = ids.find(s);
    return it == ids.end() ? -1 : it->second;
  }

  /// The vocabulary a default-constructed or moved-from Tokenizer behaves as.
  static const Impl& empty() {
    static const Impl impl;
    return impl;
  }

  [[nodiscard]] int vocab() const noexcept { return static_cast<int>(pieces.size()); }

  void check_id(int id, std::string_view what) const {
    BRIGADE_CHECK(id >= 0 && id < vocab(), Errc::InvalidArgument,
                  "Tokenizer::{}: token id {} outside [0, {})", what, id, vocab());
  }

  /// run.c's byte fallback: byte b is token b + 3 ("<0xXX>").
  [[nodiscard]] int byte_token(unsigned char b) const {
    const int id = static_cast<int>(b) + 3;
    BRIGADE_CHECK(id < vocab(), Errc::InvalidArgument,
                  "Tokenizer::encode: byte 0x{:02X} has no token in the vocabulary and its "
                  "byte-fallback id {} is outside [0, {})",
                  static_cast<unsigned>(b), id, vocab());
    return id;
  }
};

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(const Tokenizer& other)
    : impl_(std::make_unique<Impl>(other.impl_ ? *other.impl_ : Impl{})) {}
Tokenizer& Tokenizer::operator=(const Tokenizer& other) {
  if (this != &other) impl_ = std::make_unique<Impl>(other.impl_ ? *other.impl_ : Impl{});
  return *this;
}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_vocabulary(std::vector<std::string> pieces, std::vector<float> scores,
                                     std::string_view where) {
  BRIGADE_CHECK(!pieces.empty() && pieces.size() <= static_cast<std::size_t>(
                                                        std::numeric_limits<int>::max()),
                Errc::BadFile, "{}: the vocabulary has {} tokens, expected 1 to {}", where,
                pieces.size(), std::numeric_limits<int>::max());
  BRIGADE_CHECK(pieces.size() == scores.size(), Errc::BadFile,
                "{}: the vocabulary has {} pieces but {} scores", where, pieces.size(),
                scores.size());
  Tokenizer t;
  Impl& m = *t.impl_;
  for (std::size_t i = 0; i < scores.size(); ++i) {
    BRIGADE_CHECK(std::isfinite(scores[i]), Errc::BadFile,
                  "{}: token {} has merge score {}, expected a finite number (BPE merges compare "
                  "scores)",
                  where, i, scores[i]);
    BRIGADE_CHECK(pieces[i].size() <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
                  Errc::BadFile, "{}: token {} is {} bytes long, expected at most {}", where, i,
                  pieces[i].size(), std::numeric_limits<int>::max());
    m.max_token_length = std::max(m.max_token_length, static_cast<int>(pieces[i].size()));
  }
  m.pieces = std::move(pieces);
  m.scores = std::move(scores);
  m.index(where);
  return t;
}

void Tokenizer::save_llama2c(const std::filesystem::path& path) const {
  const std::string name = path.string();
  const Impl& m = impl_ ? *impl_ : Impl::empty();
  BRIGADE_CHECK(!m.pieces.empty(), Errc::InvalidArgument,
                "Tokenizer::save_llama2c({}): the vocabulary is empty", name);
  std::string bytes;
  auto put = [&](const void* p, std::size_t n) { bytes.append(static_cast<const char*>(p), n); };
  const auto max_len = static_cast<std::uint32_t>(m.max_token_length);
  put(&max_len, 4);
  for (std::size_t i = 0; i < m.pieces.size(); ++i) {
    const auto len = static_cast<std::int32_t>(m.pieces[i].size());
    put(&m.scores[i], 4);
    put(&len, 4);
    bytes += m.pieces[i];
  }
  io::write_file_atomic(path, bytes);
}

Tokenizer Tokenizer::load_llama2c(const std::filesystem::path& path, int vocab_size) {
  const std::string name = path.string();
  BRIGADE_CHECK(vocab_size > 0, Errc::InvalidArgument,
                "Tokenizer::load_llama2c({}): vocab_size = {}, expected > 0", name, vocab_size);
  const std::string bytes = io::read_input_file(path, "tokenizer file", io::kMaxTokenizerFileBytes);
  if (const auto other = io::foreign_format(std::string_view(bytes).substr(0, 16)))
    detail::fail(Errc::BadFile,
                 "{}: is {}, not a llama2.c tokenizer (brigade reads llama2.c tokenizer.bin files; "
                 "llama2.c's tokenizer.py writes them)",
                 name, *other);
  if (is_llama2c_checkpoint(path))
    detail::fail(Errc::BadFile,
                 "{}: is a llama2.c model checkpoint, not a tokenizer (were --model and "
                 "--tokenizer swapped?)",
                 name);

  const std::size_t size = bytes.size();
  std::size_t at = 0;
  auto read_u32 = [&](std::uint32_t& v) {
    std::memcpy(&v, bytes.data() + at, sizeof v);
    at += sizeof v;
  };
  BRIGADE_CHECK(size >= 4, Errc::BadFile,
                "{}: file is {} bytes, shorter than the 4-byte max_token_length header", name,
                size);
  std::uint32_t max_len = 0;
  read_u32(max_len);
  BRIGADE_CHECK(max_len <= static_cast<std::uint32_t>(std::numeric_limits<int>::max()),
                Errc::BadFile, "{}: max_token_length = {}, expected <= {}", name, max_len,
                std::numeric_limits<int>::max());

  Tokenizer t;
  Impl& m = *t.impl_;
  m.max_token_length = static_cast<int>(max_len);
  m.pieces.reserve(static_cast<std::size_t>(vocab_size));
  m.scores.reserve(static_cast<std::size_t>(vocab_size));
  for (int id = 0; id < vocab_size; ++id) {
    const std::size_t left = size - at;
    if (left == 0)
      detail::fail(Errc::BadFile,
                   "{}: file ends after {} tokens, expected vocab_size = {} tokens (too few "
                   "tokens: is vocab_size right?)",
                   name, id, vocab_size);
    if (left < 8)
      detail::fail(Errc::BadFile,
                   "{}: truncated in token {}: its score and length need 8 bytes at offset {}, "
                   "{} remain (file is {} bytes)",
                   name, id, at, left, size);
    float score = 0.0f;
    std::memcpy(&score, bytes.data() + at, sizeof score);
    at += sizeof score;
    BRIGADE_CHECK(std::isfinite(score), Errc::BadFile,
                  "{}: token {} has merge score {} at offset {}, expected a finite number (BPE "
                  "merges compare scores)",
                  name, id, score, at - 4);
    std::int32_t len = 0;
    std::memcpy(&len, bytes.data() + at, sizeof len);
    at += sizeof len;
    BRIGADE_CHECK(len >= 0, Errc::BadFile,
                  "{}: token {} has length {} at offset {}, expected >= 0", name, id, len, at - 4);
    BRIGADE_CHECK(static_cast<std::uint32_t>(len) <= max_len, Errc::BadFile,
                  "{}: token {} has length {} at offset {}, expected <= max_token_length = {}",
                  name, id, len, at - 4, max_len);
    const auto n = static_cast<std::size_t>(len);
    if (size - at < n)
      detail::fail(Errc::BadFile,
                   "{}: truncated in token {}: its {} bytes of text start at offset {}, {} remain "
                   "(file is {} bytes)",
                   name, id, n, at, size - at, size);
    m.pieces.emplace_back(bytes.data() + at, n);
    m.scores.push_back(score);
    at += n;
  }
  if (at != size)
    detail::fail(Errc::BadFile,
                 "{}: {} bytes remain after token {} (offset {} of {}): the file holds more "
                 "tokens than vocab_size = {}",
                 name, size - at, vocab_size - 1, at, size, vocab_size);
  m.index(name);
  return t;
}

Tokenizer Tokenizer::synthetic(int vocab_size, std::uint64_t seed) {
  BRIGADE_CHECK(vocab_size >= 259, Errc::InvalidArgument,
                "Tokenizer::synthetic: vocab_size = {}, expected >= 259 (3 special tokens and "
                "256 byte tokens)",
                vocab_size);
  Tokenizer t;
  Impl& m = *t.impl_;
  const auto n = static_cast<std::size_t>(vocab_size);
  m.pieces.reserve(n);
  m.pieces = {"<unk>", "\n<s>\n", "\n</s>\n"};
  for (int b = 0; b < 256; ++b) m.pieces.push_back(fmt::format("<0x{:02X}>", b));
  std::unordered_set<std::string> seen(m.pieces.begin(), m.pieces.end());
  auto add = [&](std::string s) {
    if (m.pieces.size() < n && seen.insert(s).second) m.pieces.push_back(std::move(s));
  };
  // The dummy prefix and every lowercase letter, alone and after a space, so that any
  // lowercase text encodes without byte fallback; then words grown one letter at a time from
  // an existing piece, so every word can be reached by merges.
  add(" ");
  for (char ch = 'a'; ch <= 'z'; ++ch) add(std::string(1, ch));
  for (char ch = 'a'; ch <= 'z'; ++ch) add(std::string(" ") + ch);
  const std::size_t first_word = 260;  // after " "
  std::mt19937_64 rng(seed);
  constexpr std::size_t kMaxWord = 12;
  while (m.pieces.size() < n) {
    const std::size_t from = first_word + static_cast<std::size_t>(rng() % (m.pieces.size() - first_word));
    std::string s = m.pieces[from];
    if (s.size() >= kMaxWord) continue;
    s.push_back(static_cast<char>('a' + rng() % 26));
    add(std::move(s));
  }
  m.scores.resize(n);
  std::size_t longest = 0;
  for (std::size_t i = 0; i < n; ++i) {
    m.scores[i] = i < 259 ? 0.0f : -static_cast<float>(i - 259);
    longest = std::max(longest, m.pieces[i].size());
  }
  m.max_token_length = static_cast<int>(longest);
  m.index("Tokenizer::synthetic");
  return t;
}

std::vector<int> Tokenizer::encode(std::string_view text, bool bos, bool eos) const {
  const Impl& m = impl_ ? *impl_ : Impl::empty();
  std::vector<int> tokens;
  tokens.reserve(text.size() + 3);
  if (bos) tokens.push_back(kBos);
  if (!text.empty()) {
    // run.c looks up " " for the dummy prefix; if a vocabulary lacks it, its byte token stands in.
    const int space = m.lookup(" ");
    tokens.push_back(space >= 0 ? space : m.byte_token(' '));
  }

  // One UTF-8 code point at a time (a lead byte and up to 3 continuation bytes), as run.c's
  // byte loop does: stray continuation bytes are grouped up to 4 as well.
  char buf[4];
  std::size_t len = 0;
  for (std::size_t k = 0; k < text.size(); ++k) {
    const auto ch = static_cast<unsigned char>(text[k]);
    if ((ch & 0xC0) != 0x80) len = 0;
    buf[len++] = static_cast<char>(ch);
    const bool next_continues =
        k + 1 < text.size() && (static_cast<unsigned char>(text[k + 1]) & 0xC0) == 0x80;
    if (next_continues && len < 4) continue;
    const int id = m.lookup(std::string_view(buf, len));
    if (id >= 0) {
      tokens.push_back(id);
    } else {
      for (std::size_t i = 0; i < len; ++i)
        tokens.push_back(m.byte_token(static_cast<unsigned char>(buf[i])));
    }
    len = 0;
  }

  // Merge loop (run.c's rule): each round merges the adjacent pair whose concatenation is a
  // piece with the highest score, the leftmost such pair on ties, until no pair is a piece.
  // run.c rescans every pair each round (O(n^2) on a long document); here the candidate pairs
  // sit in a max-heap ordered by (score, leftmost first) and a merge pushes only the two new
  // pairs beside it, so encoding is O(n log n) with the same merges in the same order. Tokens
  // are a linked list over their first positions (a merge keeps the left one's position, so
  // position order stays list order); a heap entry is stale once either side changed.
  const auto n = tokens.size();
  if (n > 1) {
    std::vector<std::int64_t> prev(n), next(n);
    std::vector<std::uint32_t> version(n, 0);
    for (std::size_t i = 0; i < n; ++i) {
      prev[i] = static_cast<std::int64_t>(i) - 1;
      next[i] = i + 1 < n ? static_cast<std::int64_t>(i) + 1 : -1;
    }
    struct Candidate {
      float score;
      std::int64_t left, right;
      std::uint32_t left_version, right_version;
      int id;
    };
    const auto lower = [](const Candidate& a, const Candidate& b) {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    };
    std::priority_queue<Candidate, std::vector<Candidate>, decltype(lower)> heap(lower);
    std::string joined;
    const auto push_pair = [&](std::int64_t left) {
      const auto right = next[static_cast<std::size_t>(left)];
      if (right < 0) return;
      const auto l = static_cast<std::size_t>(left), r = static_cast<std::size_t>(right);
      joined.assign(m.pieces[static_cast<std::size_t>(tokens[l])]);
      joined.append(m.pieces[static_cast<std::size_t>(tokens[r])]);
      const int id = m.lookup(joined);
      if (id < 0 || !(m.scores[static_cast<std::size_t>(id)] > kNoMergeScore)) return;
      heap.push({m.scores[static_cast<std::size_t>(id)], left, right, version[l], version[r], id});
    };
    for (std::size_t i = 0; i + 1 < n; ++i) push_pair(static_cast<std::int64_t>(i));
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      const auto l = static_cast<std::size_t>(c.left), r = static_cast<std::size_t>(c.right);
      if (version[l] != c.left_version || version[r] != c.right_version || next[l] != c.right)
        continue;  // a side merged since this pair was pushed
      tokens[l] = c.id;
      ++version[l];
      ++version[r];  // r leaves the list
      next[l] = next[r];
      if (next[l] >= 0) prev[static_cast<std::size_t>(next[l])] = c.left;
      if (prev[l] >= 0) push_pair(prev[l]);
      push_pair(c.left);
    }
    std::vector<int> merged;
    merged.reserve(n);
    for (std::int64_t i = 0; i >= 0; i = next[static_cast<std::size_t>(i)])
      merged.push_back(tokens[static_cast<std::size_t>(i)]);
    tokens = std::move(merged);
  }

  if (eos) tokens.push_back(kEos);
  return tokens;
}

std::string Tokenizer::decode(int prev, int token) const {
  const Impl& m = impl_ ? *impl_ : Impl::empty();
  m.check_id(token, "decode");
  std::string_view p = m.pieces[static_cast<std::size_t>(token)];
  if (prev == kBos && !p.empty() && p.front() == ' ') p.remove_prefix(1);
  if (p.size() == 6 && p.starts_with("<0x") && p[5] == '>') {
    const int hi = hex_value(p[3]), lo = hex_value(p[4]);
    if (hi >= 0 && lo >= 0) return std::string(1, static_cast<char>(hi * 16 + lo));
  }
  return std::string(p);
}

void Tokenizer::append_printable(std::string& out, std::string_view piece) {
  // run.c prints with printf("%s"): the piece ends at its first NUL byte.
  piece = piece.substr(0, piece.find('\0'));
  if (piece.empty()) return;
  if (piece.size() == 1 && !printable_or_space(static_cast<unsigned char>(piece[0]))) return;
  out.append(piece);
}

std::string_view Tokenizer::piece(int id) const {
  const Impl& m = impl_ ? *impl_ : Impl::empty();
  m.check_id(id, "piece");
  return m.pieces[static_cast<std::size_t>(id)];
}

float Tokenizer::score(int id) const {
  const Impl& m = impl_ ? *impl_ : Impl::empty();
  m.check_id(id, "score");
  return m.scores[static_cast<std::size_t>(id)];
}

int Tokenizer::vocab_size() const noexcept { return impl_ ? impl_->vocab() : 0; }

int Tokenizer::max_token_length() const noexcept { return impl_ ? impl_->max_token_length : 0; }

}  // namespace v0
}  // namespace brigade::model
