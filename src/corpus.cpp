// Text corpora: sample splitting, loading, held-out split and packing into micro-batches.
#include "brigade/data/corpus.hpp"

#include "brigade/batching/batcher.hpp"
#include "brigade/core/error.hpp"
#include "brigade/io/input.hpp"
#include "brigade/model/weights.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

namespace brigade::data {
inline namespace v0 {
namespace fs = std::filesystem;

namespace {

std::string_view trim_blank_lines(std::string_view s) {
  // Drop leading and trailing lines that hold only whitespace.
  auto blank = [](std::string_view line) {
    return std::all_of(line.begin(), line.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r'; });
  };
  while (!s.empty()) {
    const auto nl = s.find('\n');
    const auto line = s.substr(0, nl);
    if (!blank(line)) break;
    s.remove_prefix(nl == std::string_view::npos ? s.size() : nl + 1);
  }
  while (!s.empty()) {
    const auto nl = s.rfind('\n', s.size() - 1);
    const auto start = nl == std::string_view::npos ? 0 : nl + 1;
    const auto line = s.substr(start);
    if (!blank(line)) break;
    s = s.substr(0, nl == std::string_view::npos ? 0 : nl);
  }
  return s;
}

std::vector<std::string_view> lines_of(std::string_view text) {
  std::vector<std::string_view> out;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    out.push_back(text.substr(0, nl));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return out;
}

}  // namespace

std::vector<std::string> split_samples(std::string_view text) {
  const auto lines = lines_of(text);
  const bool fortune = std::any_of(lines.begin(), lines.end(), [](std::string_view l) {
    return l == "%" || l == "%\r";
  });
  std::vector<std::string> out;
  std::string cur;
  auto flush = [&] {
    const auto t = trim_blank_lines(cur);
    if (!t.empty()) out.emplace_back(t);
    cur.clear();
  };
  for (auto l : lines) {
    const bool sep = fortune ? (l == "%" || l == "%\r")
                             : std::all_of(l.begin(), l.end(), [](char c) {
                                 return c == ' ' || c == '\t' || c == '\r';
                               });
    if (sep) {
      flush();
      continue;
    }
    cur.append(l);
    cur.push_back('\n');
  }
  flush();
  return out;
}

fs::path default_corpus_path() { return "/usr/share/games/fortunes"; }

namespace {

/// Refuses a file that is not text: another format's magic, a llama2.c checkpoint, or a NUL
/// byte (no text encoding brigade reads has one).
void check_text(const fs::path& f, std::string_view text) {
  if (const auto other = io::foreign_format(text.substr(0, 16)))
    detail::fail(Errc::BadFile, "{}: is {}, not text (training data must be UTF-8 text)",
                 f.string(), *other);
  if (model::is_llama2c_checkpoint(f))
    detail::fail(Errc::BadFile,
                 "{}: is a llama2.c model checkpoint, not text (training data must be UTF-8 text; "
                 "the model goes to --model)",
                 f.string());
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    detail::fail(Errc::BadFile,
                 "{}: is a binary file, not text (a NUL byte at offset {}; training data must be "
                 "UTF-8 text)",
                 f.string(), nul);
}

/// The regular text files of a folder, sorted by name: symbolic links, hidden files and
/// fortune index files `*.dat` skipped.
std::vector<fs::path> text_files_of(const fs::path& folder) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const auto name = e.path().filename().string();
    if (e.is_symlink() || !e.is_regular_file() || name.empty() || name[0] == '.') continue;
    if (e.path().extension() == ".dat") continue;
    files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

namespace {

/// load_sources, naming the input `what` when no source holds a sample.
Corpus load_named(std::span<const CorpusSource> sources, const model::Tokenizer& tokenizer,
                  int max_tokens, const std::string& what) {
  BRIGADE_CHECK(max_tokens >= 2, Errc::InvalidArgument,
                "load_corpus: max_tokens = {}, expected >= 2", max_tokens);
  Corpus c;
  for (const auto& source : sources) {
    const int task = static_cast<int>(c.tasks.size());
    const auto before = c.samples.size();
    for (const auto& f : source.files) {
      const std::string text = io::read_input_file(f, "text file", io::kMaxCorpusFileBytes);
      check_text(f, text);
      std::vector<std::string> samples;
      if (source.split == SampleSplit::Paragraphs) {
        samples = split_samples(text);
      } else if (const auto doc = trim_blank_lines(text); !doc.empty()) {
        samples.emplace_back(doc);
      }
      for (const auto& s : samples) {
        auto ids = tokenizer.encode(s, true, false);
        if (ids.size() < 2) continue;
        if (static_cast<int>(ids.size()) > max_tokens) {
          ++c.truncated_samples;
          c.truncated_tokens += static_cast<std::int64_t>(ids.size()) - max_tokens;
          ids.resize(static_cast<std::size_t>(max_tokens));
        }
        c.samples.push_back({task, std::move(ids)});
      }
    }
    if (c.samples.size() > before) c.tasks.push_back(source.task);
  }
  BRIGADE_CHECK(!c.samples.empty(), Errc::BadFile, "{}: no text samples found", what);
  return c;
}

}  // namespace

Corpus load_sources(std::span<const CorpusSource> sources, const model::Tokenizer& tokenizer,
                    int max_tokens) {
  std::string names;
  for (const auto& source : sources)
    names += fmt::format("{}{}", names.empty() ? "" : ", ", source.task);
  return load_named(sources, tokenizer, max_tokens,
                    names.empty() ? std::string("the corpus (no source)")
                                  : fmt::format("the corpus of tasks {}", names));
}

Corpus load_corpus(const fs::path& path, const model::Tokenizer& tokenizer, int max_tokens) {
  BRIGADE_CHECK(max_tokens >= 2, Errc::InvalidArgument,
                "load_corpus: max_tokens = {}, expected >= 2", max_tokens);
  std::error_code ec;
  BRIGADE_CHECK(fs::exists(path, ec), Errc::BadFile, "{}: no such file or folder", path.string());
  std::vector<CorpusSource> sources;
  if (fs::is_directory(path, ec)) {
    for (const auto& f : text_files_of(path)) sources.push_back({f.filename().string(), {f}});
    BRIGADE_CHECK(!sources.empty(), Errc::BadFile, "{}: no text samples found", path.string());
  } else {
    sources.push_back({path.filename().string(), {path}});
  }
  return load_named(sources, tokenizer, max_tokens, path.string());
}

std::vector<CorpusSource> debian_sources(const fs::path& root) {
  std::vector<CorpusSource> out;
  std::error_code ec;
  const fs::path fortunes = root / "usr/share/games/fortunes";
  if (fs::is_directory(fortunes, ec))
    for (const auto& f : text_files_of(fortunes))
      out.push_back({"fortunes/" + f.filename().string(), {f}, SampleSplit::Paragraphs});
  const fs::path licenses = root / "usr/share/common-licenses";
  if (fs::is_directory(licenses, ec))
    out.push_back({"common-licenses", text_files_of(licenses), SampleSplit::Documents});
  // Per package: usr/share/doc/<package>/<name>, a regular file (not a link to another's).
  const fs::path doc = root / "usr/share/doc";
  const auto per_package = [&](const char* name) {
    std::vector<fs::path> files;
    if (!fs::is_directory(doc, ec)) return files;
    for (const auto& e : fs::directory_iterator(doc, ec)) {
      const fs::path f = e.path() / name;
      if (e.is_directory() && !e.is_symlink() && !fs::is_symlink(f, ec) &&
          fs::is_regular_file(f, ec))
        files.push_back(f);
    }
    std::sort(files.begin(), files.end());
    return files;
  };
  out.push_back({"copyright", per_package("copyright"), SampleSplit::Documents});
  out.push_back({"readme-debian", per_package("README.Debian"), SampleSplit::Documents});
  std::erase_if(out, [](const CorpusSource& s) { return s.files.empty(); });
  BRIGADE_CHECK(!out.empty(), Errc::BadFile,
                "{}: no Debian text found (usr/share/games/fortunes, usr/share/common-licenses, "
                "usr/share/doc/*/copyright, usr/share/doc/*/README.Debian; scripts/deps.sh "
                "installs fortunes)",
                root.string());
  return out;
}

std::pair<Corpus, Corpus> split_held_out(const Corpus& corpus, int every) {
  BRIGADE_CHECK(every >= 2, Errc::InvalidArgument, "split_held_out: every = {}, expected >= 2",
                every);
  Corpus train, held;
  train.tasks = held.tasks = corpus.tasks;
  std::vector<int> seen(corpus.tasks.size(), 0);
  for (const auto& s : corpus.samples) {
    auto& n = seen[static_cast<std::size_t>(s.task)];
    (n++ % every == 0 ? held : train).samples.push_back(s);
  }
  return {std::move(train), std::move(held)};
}

void append_sequence(PackedBatch& batch, const Sample& sample, std::int64_t rows) {
  BRIGADE_CHECK(rows >= 1 && rows < static_cast<std::int64_t>(sample.tokens.size()),
                Errc::InvalidArgument,
                "append_sequence: {} rows of a sample of {} tokens, expected 1 to tokens - 1", rows,
                sample.tokens.size());
  if (batch.offsets.empty()) batch.offsets.push_back(0);
  if (batch.task_offsets.empty()) batch.task_offsets.push_back(0);
  for (std::int64_t t = 0; t < rows; ++t) {
    batch.inputs.push_back(sample.tokens[static_cast<std::size_t>(t)]);
    batch.targets.push_back(sample.tokens[static_cast<std::size_t>(t) + 1]);
  }
  batch.offsets.push_back(batch.rows());
  batch.tasks.push_back(sample.task);
  batch.task_offsets.push_back(batch.rows());
}

namespace {

const Sample& sample_of(std::span<const Sample> samples, std::int64_t i, const char* who) {
  BRIGADE_CHECK(i >= 0 && i < static_cast<std::int64_t>(samples.size()), Errc::InvalidArgument,
                "{}: the micro-batch names sample {}, there are {}", who, i, samples.size());
  return samples[static_cast<std::size_t>(i)];
}

std::int64_t rows_of(const Sample& s) { return static_cast<std::int64_t>(s.tokens.size()) - 1; }

/// Appends `n` pad rows (input pad_id, target -1) to the batch's current sequence and task span.
void append_pads(PackedBatch& b, std::int64_t n, int pad_id) {
  b.inputs.insert(b.inputs.end(), static_cast<std::size_t>(n), pad_id);
  b.targets.insert(b.targets.end(), static_cast<std::size_t>(n), -1);
  b.offsets.back() = b.rows();
  b.task_offsets.back() = b.rows();
}

}  // namespace

PackedBatch pack_offsets(std::span<const Sample> samples, const batching::MicroBatch& mb) {
  PackedBatch b;
  for (const auto i : mb.samples) {
    const Sample& s = sample_of(samples, i, "pack_offsets");
    append_sequence(b, s, rows_of(s));
  }
  return b;
}

PackedBatch pack_padded(std::span<const Sample> samples, const batching::MicroBatch& mb,
                        int pad_id) {
  BRIGADE_CHECK(pad_id >= 0, Errc::InvalidArgument, "pack_padded: pad id {}, expected >= 0",
                pad_id);
  std::int64_t longest = 0;
  for (const auto i : mb.samples) longest = std::max(longest, rows_of(sample_of(samples, i, "pack_padded")));
  PackedBatch b;
  for (const auto i : mb.samples) {
    const Sample& s = samples[static_cast<std::size_t>(i)];
    append_sequence(b, s, rows_of(s));
    append_pads(b, longest - rows_of(s), pad_id);
  }
  return b;
}

PackedBatch pack_rows(std::span<const Sample> samples, const batching::MicroBatch& mb,
                      std::int64_t row_tokens, int pad_id) {
  BRIGADE_CHECK(pad_id >= 0, Errc::InvalidArgument, "pack_rows: pad id {}, expected >= 0", pad_id);
  BRIGADE_CHECK(mb.row_offsets.size() >= 2 && mb.row_offsets.back() ==
                                                  static_cast<std::int64_t>(mb.samples.size()),
                Errc::InvalidArgument,
                "pack_rows: {} row offsets for a micro-batch of {} samples; expected the "
                "PackingBatcher's rows",
                mb.row_offsets.size(), mb.samples.size());
  PackedBatch b;
  b.offsets.push_back(0);
  b.task_offsets.push_back(0);
  for (std::size_t r = 0; r + 1 < mb.row_offsets.size(); ++r) {
    const auto start = b.rows();
    const auto first = static_cast<std::size_t>(mb.row_offsets[r]);
    const auto last = static_cast<std::size_t>(mb.row_offsets[r + 1]);
    BRIGADE_CHECK(first < last, Errc::InvalidArgument, "pack_rows: row {} holds no sample", r);
    for (std::size_t k = first; k < last; ++k) {
      const Sample& s = sample_of(samples, mb.samples[k], "pack_rows");
      BRIGADE_CHECK(s.tokens.size() >= 2, Errc::InvalidArgument,
                    "pack_rows: sample {} has {} tokens, expected >= 2", mb.samples[k],
                    s.tokens.size());
      for (std::size_t t = 0; t + 1 < s.tokens.size(); ++t) {
        b.inputs.push_back(s.tokens[t]);
        b.targets.push_back(s.tokens[t + 1]);
      }
      b.tasks.push_back(s.task);
      b.task_offsets.push_back(b.rows());
    }
    const auto used = b.rows() - start;
    BRIGADE_CHECK(used <= row_tokens, Errc::InvalidArgument,
                  "pack_rows: row {} holds {} rows of samples, more than its {} tokens", r, used,
                  row_tokens);
    b.offsets.push_back(b.rows());
    append_pads(b, row_tokens - used, pad_id);
  }
  return b;
}

std::vector<Sample> Packer::next_samples(std::int64_t rows) {
  BRIGADE_CHECK(rows >= 1, Errc::InvalidArgument, "Packer: a global batch of {} rows, expected >= 1",
                rows);
  std::vector<Sample> out;
  std::int64_t used = 0;
  for (;;) {
    const Sample& s = sample_at(position_);
    BRIGADE_CHECK(s.tokens.size() >= 2, Errc::InvalidArgument,
                  "Packer: sample {} of the stream has {} tokens, expected >= 2", position_,
                  s.tokens.size());
    const auto r = std::min<std::int64_t>(static_cast<std::int64_t>(s.tokens.size()) - 1, budget_);
    if (!out.empty() && used + r > rows) break;
    out.push_back({s.task, std::vector<int>(s.tokens.begin(), s.tokens.begin() + r + 1)});
    used += r;
    ++position_;
  }
  return out;
}

Packer::Packer(std::span<const Sample> samples, int token_budget, std::uint64_t seed)
    : samples_(samples), budget_(token_budget), seed_(seed) {
  BRIGADE_CHECK(!samples.empty(), Errc::InvalidArgument, "Packer: no samples");
  BRIGADE_CHECK(token_budget >= 1, Errc::InvalidArgument,
                "Packer: token budget = {}, expected >= 1", token_budget);
}

const Sample& Packer::sample_at(std::int64_t pos) {
  const auto n = static_cast<std::int64_t>(samples_.size());
  const std::int64_t epoch = pos / n;
  if (epoch != epoch_) {
    order_.resize(samples_.size());
    std::iota(order_.begin(), order_.end(), 0);
    if (seed_ != 0) {
      std::mt19937_64 rng(seed_ + static_cast<std::uint64_t>(epoch));
      std::shuffle(order_.begin(), order_.end(), rng);
    }
    epoch_ = epoch;
  }
  return samples_[static_cast<std::size_t>(order_[static_cast<std::size_t>(pos % n)])];
}

void Packer::seek(std::int64_t pos) {
  BRIGADE_CHECK(pos >= 0, Errc::InvalidArgument, "Packer::seek: position {} < 0", pos);
  position_ = pos;
}

PackedBatch Packer::next() {
  // The stream's next samples, up to the first that fills the budget, grouped by the offsets
  // batcher (the one rule for packing by offsets); its first micro-batch is this one.
  std::vector<batching::SampleLength> window;
  std::vector<const Sample*> picked;
  std::int64_t rows = 0;
  for (std::int64_t pos = position_; rows < budget_; ++pos) {
    const Sample& s = sample_at(pos);
    BRIGADE_CHECK(s.tokens.size() >= 2, Errc::InvalidArgument,
                  "Packer: sample {} of the stream has {} tokens, expected >= 2", pos,
                  s.tokens.size());
    const auto r = std::min<std::int64_t>(static_cast<std::int64_t>(s.tokens.size()) - 1, budget_);
    window.push_back({r, s.task, pos});
    picked.push_back(&s);
    rows += r;
  }
  const auto mb = batching::OffsetsBatcher{budget_}.plan(window).front();
  PackedBatch b;
  for (const auto k : mb.samples)
    append_sequence(b, *picked[static_cast<std::size_t>(k)], window[static_cast<std::size_t>(k)].tokens);
  position_ += static_cast<std::int64_t>(mb.samples.size());
  return b;
}

}  // namespace v0
}  // namespace brigade::data
