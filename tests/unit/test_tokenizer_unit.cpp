// llama2.c tokenizer on self-written files: the reader's checks and run.c's merge semantics.
#include "brigade/core/error.hpp"
#include "brigade/model/tokenizer.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fs = std::filesystem;
using brigade::Errc;
using brigade::Error;
using brigade::model::Tokenizer;

namespace {

/// A temp directory for this file's cases.
struct TempDir : brigade::test::TempDir {
  TempDir() : brigade::test::TempDir("brigade-tokenizer") {}
};

struct Entry {
  float score;
  std::string piece;
};

/// The 259 entries every llama2.c vocabulary starts with: <unk>, BOS, EOS, <0x00>..<0xFF>.
std::vector<Entry> base_entries() {
  std::vector<Entry> e = {{0, "<unk>"}, {0, "\n<s>\n"}, {0, "\n</s>\n"}};
  for (int b = 0; b < 256; ++b) e.push_back({0, fmt::format("<0x{:02X}>", b)});
  return e;
}

/// The llama2.c tokenizer.bin bytes for `entries`.
std::vector<char> tokenizer_bytes(const std::vector<Entry>& entries, std::uint32_t max_len) {
  std::vector<char> out(4);
  std::memcpy(out.data(), &max_len, 4);
  for (const Entry& e : entries) {
    const auto len = static_cast<std::int32_t>(e.piece.size());
    const std::size_t at = out.size();
    out.resize(at + 8);
    std::memcpy(out.data() + at, &e.score, 4);
    std::memcpy(out.data() + at + 4, &len, 4);
    out.insert(out.end(), e.piece.begin(), e.piece.end());
  }
  return out;
}

void write_bytes(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

/// Writes base_entries() + `extra` and loads it back.
Tokenizer make_tokenizer(const TempDir& dir, const std::vector<Entry>& extra) {
  std::vector<Entry> all = base_entries();
  all.insert(all.end(), extra.begin(), extra.end());
  const auto p = dir / "tok.bin";
  write_bytes(p, tokenizer_bytes(all, 16));
  return Tokenizer::load_llama2c(p, static_cast<int>(all.size()));
}

/// Calls `f`, requires brigade::Error{code} whose message contains every `needle`.
void require_error(Errc code, const std::function<void()>& f,
                   std::initializer_list<std::string> needles) {
  try {
    f();
    FAIL("expected brigade::Error, nothing was thrown");
  } catch (const Error& e) {
    INFO("message: " << std::string(e.what()));
    CHECK(e.code() == code);
    for (const auto& n : needles) {
      INFO("expected to contain: " << n);
      CHECK(std::string_view(e.what()).find(n) != std::string_view::npos);
    }
  }
}

/// The id of `piece` in `t` (linear search; test helper).
int id_of(const Tokenizer& t, std::string_view piece) {
  for (int i = 0; i < t.vocab_size(); ++i)
    if (t.piece(i) == piece) return i;
  FAIL("piece not in vocabulary: " << std::string(piece));
  return -1;
}

// Ids of the extra pieces below: base_entries() holds 259 tokens.
constexpr int kSpace = 259, kA = 260, kB = 261, kC = 262;

/// A small merge table: " ", "a", "b", "c", then merges with chosen scores.
std::vector<Entry> merge_entries(std::vector<Entry> merges) {
  std::vector<Entry> e = {{-1, " "}, {-2, "a"}, {-3, "b"}, {-4, "c"}};
  e.insert(e.end(), merges.begin(), merges.end());
  return e;
}

}  // namespace

// ---- reader ---------------------------------------------------------------------------------

TEST_CASE("tokenizer.load: scores, pieces and max_token_length are read as written") {
  TempDir dir;
  const Tokenizer t = make_tokenizer(dir, {{-1.5f, " hello"}, {-2.5f, ""}, {3.0f, "\xC3\xBC"}});
  CHECK(t.vocab_size() == 262);
  CHECK(t.max_token_length() == 16);
  CHECK(t.piece(0) == "<unk>");
  CHECK(t.piece(1) == "\n<s>\n");
  CHECK(t.piece(2) == "\n</s>\n");
  CHECK(t.piece(3) == "<0x00>");
  CHECK(t.piece(258) == "<0xFF>");
  CHECK(t.piece(259) == " hello");
  CHECK(t.score(259) == -1.5f);
  CHECK(t.piece(260).empty());
  CHECK(t.piece(261) == "\xC3\xBC");
  CHECK(t.score(261) == 3.0f);
  CHECK_THROWS_AS((void)t.piece(262), Error);
  CHECK_THROWS_AS((void)t.score(-1), Error);
}

TEST_CASE("tokenizer.load: a missing file is BadFile naming the path") {
  TempDir dir;
  const auto p = dir / "missing.bin";
  require_error(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 10); },
                {p.string(), "not found"});
}

TEST_CASE("tokenizer.load: a file shorter than max_token_length is BadFile with its size") {
  TempDir dir;
  const auto p = dir / "tiny.bin";
  write_bytes(p, {'\x07', '\0'});
  require_error(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 10); },
                {p.string(), "2 bytes", "max_token_length"});
}

TEST_CASE("tokenizer.load: a file cut inside a token's score and length names the token") {
  TempDir dir;
  const auto p = dir / "cut.bin";
  std::vector<char> bytes = tokenizer_bytes({{0, "a"}, {0, "bb"}, {0, "c"}}, 4);
  bytes.resize(4 + 9 + 10 + 5);  // token 2 has 5 of its 8 score/length bytes
  write_bytes(p, bytes);
  require_error(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 3); },
                {p.string(), "truncated in token 2", "5 remain"});
}

TEST_CASE("tokenizer.load: a file cut inside a token's text names the token and lengths") {
  TempDir dir;
  const auto p = dir / "cut.bin";
  std::vector<char> bytes = tokenizer_bytes({{0, "a"}, {0, "bbbb"}}, 4);
  bytes.pop_back();  // token 1 has 3 of its 4 text bytes
  write_bytes(p, bytes);
  require_error(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 2); },
                {p.string(), "truncated in token 1", "4 bytes", "3 remain"});
}

TEST_CASE("tokenizer.load: a negative token length is BadFile naming token and length") {
  TempDir dir;
  const auto p = dir / "neg.bin";
  std::vector<char> bytes = tokenizer_bytes({{0, "a"}, {0, "b"}}, 4);
  const std::int32_t bad = -5;
  std::memcpy(bytes.data() + 4 + 9 + 4, &bad, 4);  // token 1's length
  write_bytes(p, bytes);
  require_error(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 2); },
                {p.string(), "token 1", "length -5", ">= 0"});
}

TEST_CASE("tokenizer.load: a token longer than max_token_length is BadFile naming both") {
  TempDir dir;
  const auto p = dir / "long.bin";
  write_bytes(p, tokenizer_bytes({{0, "a"}, {0, "abcdef"}}, 4));
  require_error(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 2); },
                {p.string(), "token 1", "length 6", "max_token_length = 4"});
}

TEST_CASE("tokenizer.load: bytes after the last token (vocab_size too small) are BadFile") {
  TempDir dir;
  const auto p = dir / "more.bin";
  write_bytes(p, tokenizer_bytes({{0, "a"}, {0, "b"}, {0, "c"}}, 4));
  require_error(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 2); },
                {p.string(), "9 bytes remain after token 1", "vocab_size = 2"});
}

TEST_CASE("tokenizer.load: fewer tokens than vocab_size is BadFile with both counts") {
  TempDir dir;
  const auto p = dir / "fewer.bin";
  write_bytes(p, tokenizer_bytes({{0, "a"}, {0, "b"}, {0, "c"}}, 4));
  require_error(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 5); },
                {p.string(), "after 3 tokens", "vocab_size = 5"});
}

TEST_CASE("tokenizer.load: a non-positive vocab_size is InvalidArgument") {
  TempDir dir;
  const auto p = dir / "ok.bin";
  write_bytes(p, tokenizer_bytes({{0, "a"}}, 4));
  require_error(Errc::InvalidArgument, [&] { (void)Tokenizer::load_llama2c(p, 0); },
                {"vocab_size = 0"});
}

// ---- encode: merges -------------------------------------------------------------------------

TEST_CASE("tokenizer.encode: the pair with the highest score merges first") {
  TempDir dir;
  // "bc" outranks "ab", so "abc" is built as a + bc, which exists as "abc".
  const Tokenizer t = make_tokenizer(
      dir, merge_entries({{-10, "ab"}, {-5, "bc"}, {-20, "abc"}}));
  const int ab = 263, bc = 264, abc = 265;
  CHECK(t.encode("abc", false, false) == std::vector<int>{kSpace, abc});
  CHECK(t.encode("ab", false, false) == std::vector<int>{kSpace, ab});
  CHECK(t.encode("bcab", false, false) == std::vector<int>{kSpace, bc, ab});
  // "cab": "ca" is absent, only "ab" merges.
  CHECK(t.encode("cab", false, false) == std::vector<int>{kSpace, kC, ab});
}

TEST_CASE("tokenizer.encode: merging order depends on scores (bc before ab, or ab before bc)") {
  TempDir dir;
  // With "ab" outranking "bc", "abc" becomes ab + c and "abc" is reached through "ab"+"c".
  const Tokenizer t = make_tokenizer(dir, merge_entries({{-5, "ab"}, {-10, "bc"}}));
  const int ab = 263, bc = 264;
  CHECK(t.encode("abc", false, false) == std::vector<int>{kSpace, ab, kC});
  CHECK(t.encode("bbc", false, false) == std::vector<int>{kSpace, kB, bc});
}

TEST_CASE("tokenizer.encode: on equal scores the leftmost pair merges") {
  TempDir dir;
  const Tokenizer t = make_tokenizer(dir, merge_entries({{-5, "ab"}, {-5, "ba"}}));
  const int ab = 263, ba = 264;
  CHECK(t.encode("aba", false, false) == std::vector<int>{kSpace, ab, kA});
  CHECK(t.encode("bab", false, false) == std::vector<int>{kSpace, ba, kB});
  CHECK(t.encode("abab", false, false) == std::vector<int>{kSpace, ab, ab});
}

TEST_CASE("tokenizer.encode: merges repeat until no pair is in the vocabulary") {
  TempDir dir;
  const Tokenizer t = make_tokenizer(
      dir, merge_entries({{-5, " a"}, {-6, "aa"}, {-7, " aa"}, {-8, " aaaa"}, {-9, "aaa"}}));
  const int sp_a = 263, aa = 264, sp_aa = 265, sp_aaaa = 266, aaa = 267;
  // " a" first (the dummy prefix merges into the word), then " a"+"a".
  CHECK(t.encode("a", false, false) == std::vector<int>{sp_a});
  CHECK(t.encode("aa", false, false) == std::vector<int>{sp_aa});
  // Greedy by score, not longest match: "aa" (-6) beats " aa" (-7), and " a"+"aa" is no piece.
  CHECK(t.encode("aaa", false, false) == std::vector<int>{sp_a, aa});
  // ... whereas here " a" + "aa" + "a" -> " a" + "aaa" -> " aaaa".
  CHECK(t.encode("aaaa", false, false) == std::vector<int>{sp_aaaa});
  CHECK(t.encode("aaaaa", false, false) == std::vector<int>{sp_a, aa, aa});
  CHECK(t.encode("aaaaaa", false, false) == std::vector<int>{sp_a, aa, aaa});
}

TEST_CASE("tokenizer.encode: a merge scoring at or below -1e10 never happens (run.c's floor)") {
  TempDir dir;
  const Tokenizer t = make_tokenizer(dir, merge_entries({{-2e10f, "cc"}, {-1e10f, "bb"}}));
  CHECK(t.encode("cc", false, false) == std::vector<int>{kSpace, kC, kC});
  CHECK(t.encode("bb", false, false) == std::vector<int>{kSpace, kB, kB});
}

TEST_CASE("tokenizer.encode: BOS, EOS and the dummy prefix") {
  TempDir dir;
  const Tokenizer t = make_tokenizer(dir, merge_entries({}));
  CHECK(t.encode("", false, false).empty());
  CHECK(t.encode("", true, false) == std::vector<int>{1});
  CHECK(t.encode("", false, true) == std::vector<int>{2});
  CHECK(t.encode("", true, true) == std::vector<int>{1, 2});
  CHECK(t.encode("ab", true, true) == std::vector<int>{1, kSpace, kA, kB, 2});
  CHECK(t.encode(" a", false, false) == std::vector<int>{kSpace, kSpace, kA});
}

TEST_CASE("tokenizer.encode: without a \" \" piece the dummy prefix is the byte token 0x20") {
  TempDir dir;
  const Tokenizer t = make_tokenizer(dir, {{-1, "a"}});
  CHECK(t.encode("a", false, false) == std::vector<int>{0x20 + 3, 259});
}

// ---- encode: UTF-8 and byte fallback --------------------------------------------------------

TEST_CASE("tokenizer.encode: a code point in the vocabulary is one token, others fall back to bytes") {
  TempDir dir;
  const Tokenizer t = make_tokenizer(
      dir, merge_entries({{-9, "\xC3\xA9"}, {-9, "\xF0\x9F\x98\x80"}}));
  const int e_acute = 263, grin = 264;
  CHECK(t.encode("\xC3\xA9", false, false) == std::vector<int>{kSpace, e_acute});
  // u-umlaut is absent: its two UTF-8 bytes + 3.
  CHECK(t.encode("\xC3\xBC", false, false) == std::vector<int>{kSpace, 0xC3 + 3, 0xBC + 3});
  CHECK(t.encode("a\xC3\xBC" "b", false, false) ==
        std::vector<int>{kSpace, kA, 0xC3 + 3, 0xBC + 3, kB});
  CHECK(t.encode("\xF0\x9F\x98\x80", false, false) == std::vector<int>{kSpace, grin});
  // An absent 4-byte code point: four byte tokens.
  CHECK(t.encode("\xF0\x9F\x98\x81", false, false) ==
        std::vector<int>{kSpace, 0xF0 + 3, 0x9F + 3, 0x98 + 3, 0x81 + 3});
}

TEST_CASE("tokenizer.encode: continuation bytes group at most 4 bytes as run.c's loop does") {
  TempDir dir;
  const Tokenizer t = make_tokenizer(
      dir, merge_entries({{-9, "\xF0\x9F\x98\x80"}, {-9, "\x80\x80"}}));
  const int grin = 263, cont2 = 264;
  // A fifth continuation byte starts a new group of its own.
  CHECK(t.encode("\xF0\x9F\x98\x80\x80", false, false) ==
        std::vector<int>{kSpace, grin, 0x80 + 3});
  // Stray continuation bytes at the start group together: "\x80\x80" is one piece.
  CHECK(t.encode("\x80\x80" "a", false, false) == std::vector<int>{kSpace, cont2, kA});
  // A NUL byte is a character like any other (run.c would stop at it).
  CHECK(t.encode(std::string_view("a\0b", 3), false, false) ==
        std::vector<int>{kSpace, kA, 3, kB});
}

TEST_CASE("tokenizer.encode: a byte without a fallback token in a small vocabulary is InvalidArgument") {
  TempDir dir;
  const auto p = dir / "small.bin";
  write_bytes(p, tokenizer_bytes({{0, "<unk>"}, {0, "\n<s>\n"}, {0, "\n</s>\n"}, {0, " "}}, 8));
  const Tokenizer t = Tokenizer::load_llama2c(p, 4);
  CHECK(t.encode("", true, false) == std::vector<int>{1});
  require_error(Errc::InvalidArgument, [&] { (void)t.encode("x", false, false); },
                {"0x78", "123"});
}

// ---- decode and printing --------------------------------------------------------------------

TEST_CASE("tokenizer.decode: leading space dropped after BOS and <0xXX> is one raw byte") {
  TempDir dir;
  const Tokenizer t = make_tokenizer(dir, merge_entries({{-5, " hi"}, {-6, "<0x4"}}));
  const int hi = 263, partial = 264;
  CHECK(t.decode(1, hi) == "hi");
  CHECK(t.decode(kA, hi) == " hi");
  CHECK(t.decode(1, kSpace).empty());
  CHECK(t.decode(kA, 0x41 + 3) == "A");
  CHECK(t.decode(kA, 0x0A + 3) == "\n");
  CHECK(t.decode(1, 0xC3 + 3) == "\xC3");
  CHECK(t.decode(kA, 3) == std::string(1, '\0'));
  CHECK(t.decode(kA, partial) == "<0x4");
  CHECK(t.decode(kA, 1) == "\n<s>\n");
  require_error(Errc::InvalidArgument, [&] { (void)t.decode(1, t.vocab_size()); },
                {"decode", std::to_string(t.vocab_size())});
  require_error(Errc::InvalidArgument, [&] { (void)t.decode(1, -1); }, {"-1"});
}

TEST_CASE("tokenizer.append_printable: drops empty and unprintable single bytes like safe_printf") {
  std::string out;
  Tokenizer::append_printable(out, "");
  Tokenizer::append_printable(out, std::string_view("\0", 1));
  Tokenizer::append_printable(out, "\x01");
  Tokenizer::append_printable(out, "\x7F");
  Tokenizer::append_printable(out, "\xC3");
  CHECK(out.empty());
  Tokenizer::append_printable(out, "a");
  Tokenizer::append_printable(out, "\n");
  Tokenizer::append_printable(out, "\t");
  Tokenizer::append_printable(out, " ");
  Tokenizer::append_printable(out, "\xC3\xBC");
  Tokenizer::append_printable(out, "\x01\x02");  // several bytes are printed as they are
  Tokenizer::append_printable(out, std::string_view("x\0y", 3));  // printf stops at NUL
  CHECK(out == "a\n\t \xC3\xBC\x01\x02x");
}

// ---- synthetic ------------------------------------------------------------------------------

TEST_CASE("tokenizer.synthetic: special and byte tokens, unique pseudo-words, descending scores") {
  const Tokenizer t = Tokenizer::synthetic(2000, 9);
  CHECK(t.vocab_size() == 2000);
  CHECK(t.piece(0) == "<unk>");
  CHECK(t.piece(1) == "\n<s>\n");
  CHECK(t.piece(2) == "\n</s>\n");
  CHECK(t.piece(3) == "<0x00>");
  CHECK(t.piece(3 + 0xAB) == "<0xAB>");
  CHECK(t.piece(258) == "<0xFF>");
  std::set<std::string> seen;
  int with_space = 0;
  for (int i = 0; i < t.vocab_size(); ++i) {
    const std::string p(t.piece(i));
    CHECK(seen.insert(p).second);
    CHECK(static_cast<int>(p.size()) <= t.max_token_length());
    if (i > 0) CHECK(t.score(i) <= t.score(i - 1));
    if (i >= 259) {
      CHECK_FALSE(p.empty());
      const std::string_view word = p.front() == ' ' ? std::string_view(p).substr(1) : p;
      for (const char ch : word) CHECK((ch >= 'a' && ch <= 'z'));
      with_space += p.front() == ' ' ? 1 : 0;
    }
  }
  CHECK(with_space > 100);
  CHECK(with_space < 2000 - 259 - 100);
}

TEST_CASE("tokenizer.synthetic: reproducible from the seed and different for another seed") {
  const Tokenizer a = Tokenizer::synthetic(1000, 3), b = Tokenizer::synthetic(1000, 3),
                  c = Tokenizer::synthetic(1000, 4);
  bool all_same = true, any_diff = false;
  for (int i = 0; i < 1000; ++i) {
    all_same = all_same && a.piece(i) == b.piece(i) && a.score(i) == b.score(i);
    any_diff = any_diff || a.piece(i) != c.piece(i);
  }
  CHECK(all_same);
  CHECK(any_diff);
}

TEST_CASE("tokenizer.synthetic: lowercase text encodes without byte fallback and decodes back") {
  const Tokenizer t = Tokenizer::synthetic(4000, 1);
  const std::string text = "the quick brown fox jumps over the lazy dog";
  const std::vector<int> ids = t.encode(text, true, false);
  REQUIRE(ids.size() >= 2);
  CHECK(ids.front() == 1);
  CHECK(ids.size() < text.size());  // merges happened
  std::string out;
  for (std::size_t i = 1; i < ids.size(); ++i) {
    CHECK(ids[i] >= 259);
    Tokenizer::append_printable(out, t.decode(ids[i - 1], ids[i]));
  }
  CHECK(out == text);
}

TEST_CASE("tokenizer.synthetic: fewer than 259 tokens is InvalidArgument") {
  require_error(Errc::InvalidArgument, [] { (void)Tokenizer::synthetic(258, 1); },
                {"258", "259"});
  CHECK(Tokenizer::synthetic(259, 1).vocab_size() == 259);
}

TEST_CASE("tokenizer.value semantics: copies are independent and moved-from is empty") {
  Tokenizer a = Tokenizer::synthetic(300, 1);
  Tokenizer b = a;
  CHECK(b.vocab_size() == 300);
  CHECK(b.piece(299) == a.piece(299));
  Tokenizer c = std::move(a);
  CHECK(c.vocab_size() == 300);
  CHECK(a.vocab_size() == 0);  // NOLINT(bugprone-use-after-move): documented state
  a = c;
  CHECK(a.encode("ab", true, false) == c.encode("ab", true, false));
  const Tokenizer empty;
  CHECK(empty.vocab_size() == 0);
  CHECK(empty.encode("", true, false) == std::vector<int>{1});
  CHECK(id_of(c, "<0x41>") == 0x41 + 3);
}

// ---- encode at length: the heap-ordered merges are run.c's rescan, merge for merge -----------

namespace {

/// run.c's encode as written there: code points to pieces (byte fallback), then rounds that
/// rescan every adjacent pair and merge the highest-scoring one (the leftmost on ties). O(n^2):
/// the reference the library's O(n log n) encode must equal.
std::vector<int> rescan_encode(const Tokenizer& t, std::string_view text) {
  std::unordered_map<std::string, int> id_of;
  for (int i = t.vocab_size() - 1; i >= 0; --i) id_of[std::string(t.piece(i))] = i;
  const auto lookup = [&](const std::string& s) {
    const auto it = id_of.find(s);
    return it == id_of.end() ? -1 : it->second;
  };
  std::vector<int> tokens{1};  // BOS
  if (!text.empty()) tokens.push_back(lookup(" ") >= 0 ? lookup(" ") : 3 + ' ');
  std::string cp;
  for (std::size_t k = 0; k < text.size(); ++k) {
    const auto ch = static_cast<unsigned char>(text[k]);
    if ((ch & 0xC0) != 0x80) cp.clear();
    cp.push_back(static_cast<char>(ch));
    const bool next_continues =
        k + 1 < text.size() && (static_cast<unsigned char>(text[k + 1]) & 0xC0) == 0x80;
    if (next_continues && cp.size() < 4) continue;
    if (const int id = lookup(cp); id >= 0) {
      tokens.push_back(id);
    } else {
      for (const char b : cp) tokens.push_back(3 + static_cast<unsigned char>(b));
    }
    cp.clear();
  }
  for (;;) {
    float best_score = -1e10f;
    std::size_t best = tokens.size();
    int best_id = -1;
    for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
      const int id = lookup(std::string(t.piece(tokens[i])) + std::string(t.piece(tokens[i + 1])));
      if (id >= 0 && t.score(id) > best_score) {
        best_score = t.score(id);
        best = i;
        best_id = id;
      }
    }
    if (best_id < 0) break;
    tokens[best] = best_id;
    tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  return tokens;
}

}  // namespace

TEST_CASE("tokenizer.encode: long texts merge exactly as run.c's rescan (synthetic vocabulary, "
          "ties, UTF-8 and byte fallback)") {
  const Tokenizer t = Tokenizer::synthetic(3000, 5);
  std::mt19937 rng(15);
  std::string text;
  // Pseudo-words of the vocabulary, random lowercase runs, punctuation, UTF-8 and stray bytes.
  const char* extra[] = {" ", ", ", ".\n\n", " \xC3\xBC", "\xE2\x82\xAC", "\x80", "  ", "\t"};
  for (int i = 0; i < 3000; ++i) {
    const int kind = static_cast<int>(rng() % 4);
    if (kind == 0) {
      text += t.piece(259 + static_cast<int>(rng() % 2741));
    } else if (kind == 1) {
      for (int k = 0, n = 1 + static_cast<int>(rng() % 6); k < n; ++k)
        text.push_back(static_cast<char>('a' + rng() % 26));
    } else {
      text += extra[rng() % std::size(extra)];
    }
  }
  REQUIRE(text.size() > 8000);
  const auto got = t.encode(text, true, false);
  CHECK(got == rescan_encode(t, text));
  CHECK(got.size() * 5 < text.size() * 4);  // merges happened (6290 tokens of 9632 bytes)

  // Equal scores everywhere: the leftmost pair wins each round.
  const TempDir dir;
  const Tokenizer ties = make_tokenizer(
      dir, {{0, " "}, {0, "a"}, {0, "b"}, {0, "ab"}, {0, "ba"}, {0, "aba"}, {0, "bab"}, {0, " a"}});
  std::string abab;
  for (int i = 0; i < 500; ++i) abab += (rng() % 3 == 0) ? "b" : "a";
  CHECK(ties.encode(abab, true, false) == rescan_encode(ties, abab));
}
