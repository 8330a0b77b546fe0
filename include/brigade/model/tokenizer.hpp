// llama2.c's BPE tokenizer: encode by merge score, byte fallback, dummy prefix, BOS/EOS.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::model {
inline namespace v0 {

/// A SentencePiece-style BPE vocabulary as llama2.c stores it (tokenizer.bin), with run.c's
/// encode and decode semantics.
class Tokenizer {
 public:
  static constexpr int kUnk = 0;  ///< <unk>
  static constexpr int kBos = 1;  ///< beginning of sequence
  static constexpr int kEos = 2;  ///< end of sequence

  /// Loads a llama2.c tokenizer file: uint32 max_token_length, then for each of `vocab_size`
  /// tokens a float32 merge score, an int32 length and that many UTF-8 bytes.
  /// @param vocab_size tokens to read (the model's vocab_size, as run.c does)
  /// @throws brigade::Error{BadFile} naming the file, the token id and the values when the file
  ///         is missing or truncated, a length is negative or exceeds max_token_length, bytes
  ///         remain after the last token (vocab_size too small), or the file holds fewer than
  ///         vocab_size tokens, a merge score is NaN or infinite; naming the piece (a 32-byte excerpt) and both ids when two ids
  ///         hold the same piece (run.c's binary search would then pick either); when the file
  ///         is not a regular file (a directory, FIFO, device), is larger than
  ///         io::kMaxTokenizerFileBytes, starts with another format's magic (io::foreign_format:
  ///         GGUF, safetensors, zip, pickle, ELF, ...), or is a llama2.c model checkpoint
  /// @throws brigade::Error{InvalidArgument} if vocab_size <= 0
  static Tokenizer load_llama2c(const std::filesystem::path& path, int vocab_size);

  /// A vocabulary from its pieces and merge scores (id i is pieces[i]), in llama2.c's form
  /// (spaces as " ", byte tokens "<0xXX>" at ids 3..258, BOS "\n<s>\n"): what a loader of
  /// another file format (load_gguf_tokenizer) builds. max_token_length() is the longest piece.
  /// @param where names the source in messages (a file path)
  /// @throws brigade::Error{BadFile} naming `where`: no pieces, more than INT32_MAX, pieces and
  ///         scores of different lengths, a non-finite score (its id), a piece longer than
  ///         INT32_MAX bytes, a piece stored twice (both ids)
  static Tokenizer from_vocabulary(std::vector<std::string> pieces, std::vector<float> scores,
                                   std::string_view where);

  /// Writes the vocabulary as a llama2.c tokenizer file (the layout load_llama2c reads:
  /// uint32 max_token_length, then per token float32 score, int32 length, the bytes),
  /// atomically (`path` + ".tmp", fsync, rename; the temporary is removed on failure).
  /// load_llama2c(path, vocab_size()) reads back the same pieces and scores.
  /// @throws brigade::Error{InvalidArgument} if the vocabulary is empty
  /// @throws brigade::Error{BadFile} naming the file if it cannot be written or renamed
  void save_llama2c(const std::filesystem::path& path) const;

  /// A made-up vocabulary for synthetic models: ids 0..2 special, 3..258 byte fallback
  /// "<0xXX>", the rest pseudo-words built from `seed` (scores descending with id). Id 259 is
  /// " ", then "a".."z" and " a".." z" (as room allows), then unique lowercase words of up to 12
  /// bytes, some with a leading space, each grown by one letter from an earlier piece so that
  /// merges reach it. Scores are 0 below 259 and -(id - 259) from there, as in tok512.bin.
  /// @throws brigade::Error{InvalidArgument} if vocab_size < 259
  static Tokenizer synthetic(int vocab_size, std::uint64_t seed);

  /// Token ids of `text` as run.c's encode(): BOS if `bos`; a dummy-prefix " " token if the
  /// text is non-empty; each UTF-8 code point as its token or, if absent, its bytes as
  /// byte-fallback ids (byte + 3); then repeatedly the adjacent pair whose concatenation is in
  /// the vocabulary with the highest score is merged (the leftmost pair on ties; a score must
  /// exceed -1e10, run.c's starting value); EOS if `eos`. Where run.c's C strings give no
  /// answer: a NUL byte is encoded like any byte (run.c stops at it); a vocabulary without
  /// " " gets the byte token of 0x20 as dummy prefix. (A vocabulary never holds a piece
  /// twice: load_llama2c refuses that.)
  /// @throws brigade::Error{InvalidArgument} if a byte needs its fallback token (byte + 3) and
  ///         that id is outside [0, vocab_size)
  [[nodiscard]] std::vector<int> encode(std::string_view text, bool bos, bool eos) const;

  /// The text run.c prints for `token` after `prev`: the piece, with its leading space dropped
  /// when prev is BOS, and a "<0xXX>" piece (exactly 6 bytes, two hex digits of either case)
  /// as that single raw byte.
  /// @throws brigade::Error{InvalidArgument} if token is outside [0, vocab_size)
  [[nodiscard]] std::string decode(int prev, int token) const;

  /// Appends `piece` to `out` as run.c's safe_printf prints it: an empty piece, or a single
  /// byte that is neither printable nor whitespace, is dropped.
  /// As printf("%s") does, the piece ends at its first NUL byte. "Printable" and "whitespace"
  /// are the "C" locale's isprint/isspace.
  static void append_printable(std::string& out, std::string_view piece);

  /// The stored piece of `id` ("<0x0A>", " Once", ...).
  /// @throws brigade::Error{InvalidArgument} if id is outside [0, vocab_size)
  [[nodiscard]] std::string_view piece(int id) const;
  /// The merge score of `id`.
  /// @throws brigade::Error{InvalidArgument} if id is outside [0, vocab_size)
  [[nodiscard]] float score(int id) const;
  /// Number of tokens (0 for a default-constructed Tokenizer).
  [[nodiscard]] int vocab_size() const noexcept;
  /// Longest piece in bytes: the file's max_token_length header, or the longest synthetic piece.
  [[nodiscard]] int max_token_length() const noexcept;

  /// An empty vocabulary (vocab_size() == 0); a moved-from Tokenizer is in this state too.
  Tokenizer();
  ~Tokenizer();
  Tokenizer(const Tokenizer&);
  Tokenizer& operator=(const Tokenizer&);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace v0
}  // namespace brigade::model
