// Corpus splitting, loading (folders, the Debian multi-task corpus) and packing; the AdamW schedule.
#include <brigade/data/corpus.hpp>
#include <brigade/engine/optimizer.hpp>

#include "test_util.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>

using brigade::test::rel;

using namespace brigade;
namespace fs = std::filesystem;

TEST_CASE("corpus.split: fortune files split on % lines, other text on blank lines") {
  const auto f = data::split_samples("first one\nline two\n%\n\nsecond\n%\n%\nthird\n");
  REQUIRE(f.size() == 3);
  CHECK(f[0] == "first one\nline two");
  CHECK(f[1] == "second");
  CHECK(f[2] == "third");
  const auto t = data::split_samples("\n\npara one\nstill one\n\n  \npara two\n");
  REQUIRE(t.size() == 2);
  CHECK(t[0] == "para one\nstill one");
  CHECK(t[1] == "para two");
  CHECK(data::split_samples("").empty());
}

TEST_CASE("corpus.packer: micro-batches hold whole samples within the budget, by offsets") {
  std::vector<data::Sample> s{{0, {1, 10, 11, 12}}, {1, {1, 20}}, {0, {1, 30, 31}},
                              {2, {1, 40, 41, 42, 43, 44, 45, 46}}};
  data::Packer p(s, 5, 0);
  auto a = p.next();  // 3 rows + 1 row; the next sample (2 rows) does not fit
  CHECK(a.inputs == std::vector<std::int32_t>{1, 10, 11, 1});
  CHECK(a.targets == std::vector<std::int32_t>{10, 11, 12, 20});
  CHECK(a.offsets == std::vector<std::int64_t>{0, 3, 4});
  CHECK(a.tasks == std::vector<std::int32_t>{0, 1});
  auto b = p.next();  // 2 rows; the 7-row sample does not fit beside it
  CHECK(b.offsets == std::vector<std::int64_t>{0, 2});
  auto c = p.next();  // the long sample, truncated to the budget
  CHECK(c.inputs == std::vector<std::int32_t>{1, 40, 41, 42, 43});
  CHECK(c.targets == std::vector<std::int32_t>{40, 41, 42, 43, 44});
  CHECK(p.position() == 4);
  auto d = p.next();  // epoch 2 starts over
  CHECK(d.inputs == a.inputs);
  p.seek(1);
  CHECK(p.next().inputs == std::vector<std::int32_t>{1, 1, 30});
  CHECK_THROWS_AS(data::Packer({}, 5, 0), Error);
  CHECK_THROWS_AS(data::Packer(s, 0, 0), Error);
  const std::vector<data::Sample> one_token{{0, {1, 10}}, {0, {1}}};
  data::Packer q(one_token, 5, 0);
  CHECK_THROWS_WITH_AS(q.next(), doctest::Contains("sample 1 of the stream has 1 tokens"), Error);
}

TEST_CASE("corpus.pack_offsets: a batcher's micro-batch as rows by offsets, in its order") {
  const std::vector<data::Sample> s{{0, {1, 10, 11, 12}}, {1, {1, 20}}, {2, {1, 30, 31}}};
  batching::MicroBatch mb;
  mb.samples = {2, 0};
  const auto b = data::pack_offsets(s, mb);
  CHECK(b.inputs == std::vector<std::int32_t>{1, 30, 1, 10, 11});
  CHECK(b.targets == std::vector<std::int32_t>{30, 31, 10, 11, 12});
  CHECK(b.offsets == std::vector<std::int64_t>{0, 2, 5});
  CHECK(b.tasks == std::vector<std::int32_t>{2, 0});
  CHECK(b.task_offsets == std::vector<std::int64_t>{0, 2, 5});  // a task span per sequence
  mb.samples = {0, 3};
  CHECK_THROWS_WITH_AS((void)data::pack_offsets(s, mb),
                       doctest::Contains("the micro-batch names sample 3, there are 3"), Error);
  const std::vector<data::Sample> one_token{{0, {1}}};
  mb.samples = {0};
  CHECK_THROWS_WITH_AS((void)data::pack_offsets(one_token, mb),
                       doctest::Contains("0 rows of a sample of 1 tokens"), Error);
  data::PackedBatch out;
  CHECK_THROWS_WITH_AS(data::append_sequence(out, s[0], 4),
                       doctest::Contains("4 rows of a sample of 4 tokens"), Error);
}

TEST_CASE("corpus.packer: a seed shuffles each epoch reproducibly") {
  std::vector<data::Sample> s;
  for (int i = 0; i < 50; ++i) s.push_back({0, {1, 100 + i}});
  data::Packer a(s, 1, 7), b(s, 1, 7), c(s, 1, 8);
  std::vector<int> ra, rb, rc;
  for (int i = 0; i < 50; ++i) {
    ra.push_back(a.next().targets[0]);
    rb.push_back(b.next().targets[0]);
    rc.push_back(c.next().targets[0]);
  }
  CHECK(ra == rb);
  CHECK(ra != rc);
  auto sorted = ra;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 50; ++i) CHECK(sorted[static_cast<std::size_t>(i)] == 100 + i);
}

TEST_CASE("corpus.load: a folder is one task per file, errors name the path") {
  const fs::path dir = fs::temp_directory_path() / "brigade_corpus_test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "b_task") << "x y\n%\nz\n";
  std::ofstream(dir / "a_task") << "hello\n\nworld\n";
  std::ofstream(dir / "a_task.dat") << "binary index";
  const auto tok = model::Tokenizer::synthetic(600, 3);
  const auto c = data::load_corpus(dir, tok, 64);
  CHECK(c.tasks == std::vector<std::string>{"a_task", "b_task"});
  REQUIRE(c.samples.size() == 4);
  CHECK(c.samples[0].task == 0);
  CHECK(c.samples[2].task == 1);
  CHECK(c.samples[0].tokens == tok.encode("hello", true, false));
  const auto [train, held] = data::split_held_out(c, 2);
  CHECK(held.samples.size() == 2);  // the 0th of each task
  CHECK(train.samples.size() == 2);
  CHECK_THROWS_WITH_AS(data::load_corpus(dir / "missing", tok, 64),
                       doctest::Contains("missing: no such file or folder"), Error);
  fs::create_directories(dir / "empty");
  CHECK_THROWS_WITH_AS(data::load_corpus(dir / "empty", tok, 64),
                       doctest::Contains("no text samples"), Error);
  fs::remove_all(dir);
}

TEST_CASE("optimizer.adamw: warm-up and cosine schedule, and one step by hand") {
  engine::AdamWConfig cfg;
  cfg.lr = 1e-3f;
  cfg.min_lr = 1e-4f;
  cfg.warmup_steps = 4;
  cfg.decay_steps = 14;
  CHECK(cfg.lr_at(0) == rel(2.5e-4));
  CHECK(cfg.lr_at(3) == rel(1e-3));
  CHECK(cfg.lr_at(9) == rel(1e-4 + 0.5 * 9e-4));  // halfway: cos(pi/2) = 0
  CHECK(cfg.lr_at(14) == rel(1e-4));
  CHECK(cfg.lr_at(100) == rel(1e-4));

  float w[2] = {1.0f, -2.0f};
  float g[2] = {0.5f, 3.0f};
  cfg.clip_norm = 1.0f;
  engine::AdamW opt({{w, g, 2, true}}, cfg);
  const double norm = std::sqrt(0.25 + 9.0);
  const float lr = opt.step(norm);
  // First step: m_hat = g', v_hat = g'^2, so the update is lr * (sign(g') + wd * w).
  CHECK(lr == rel(2.5e-4));
  CHECK(w[0] == doctest::Approx(1.0 - 2.5e-4 * (1.0 + 0.1 * 1.0)).epsilon(1e-6));
  CHECK(w[1] == doctest::Approx(-2.0 - 2.5e-4 * (1.0 + 0.1 * -2.0)).epsilon(1e-6));
  CHECK(opt.steps() == 1);
}

// issue 15: the multi-task corpus of Debian's plain text, one task per source, short fortunes
// beside long documents.
TEST_CASE("corpus.debian: one task per source under a root, documents whole, links and index "
          "files skipped, a binary file and an empty root are named errors") {
  const fs::path root = fs::temp_directory_path() / "brigade_debian_corpus_test";
  fs::remove_all(root);
  const fs::path fortunes = root / "usr/share/games/fortunes";
  const fs::path licenses = root / "usr/share/common-licenses";
  const fs::path doc = root / "usr/share/doc";
  for (const auto& d : {fortunes, licenses, doc / "pkg-a", doc / "pkg-b", doc / "pkg-c"})
    fs::create_directories(d);
  std::ofstream(fortunes / "art") << "one\n%\ntwo words\n%\nthree\n";
  std::ofstream(fortunes / "art.dat") << "index";
  fs::create_symlink(fortunes / "art", fortunes / "art.u8");
  std::string gpl;  // a long document of many paragraphs: one sample
  for (int i = 0; i < 40; ++i) gpl += "Paragraph " + std::to_string(i) + " of the license text.\n\n";
  std::ofstream(licenses / "GPL-3") << "\n" << gpl;
  fs::create_symlink(licenses / "GPL-3", licenses / "GPL");
  std::ofstream(licenses / "BSD") << "Redistribution and use.\n\nWith or without modification.\n";
  std::ofstream(doc / "pkg-a/copyright") << "Files: *\nCopyright: someone\n\nLicense: BSD\n";
  std::ofstream(doc / "pkg-b/copyright") << "Files: *\n\nLicense: GPL-3\n";
  std::ofstream(doc / "pkg-b/README.Debian") << "Notes for Debian.\n\nSee the docs.\n";
  fs::create_symlink(doc / "pkg-a/copyright", doc / "pkg-c/copyright");

  const auto sources = data::debian_sources(root);
  REQUIRE(sources.size() == 4);
  CHECK(sources[0].task == "fortunes/art");
  CHECK(sources[0].files == std::vector<fs::path>{fortunes / "art"});
  CHECK(sources[1].task == "common-licenses");
  CHECK(sources[1].files == std::vector<fs::path>{licenses / "BSD", licenses / "GPL-3"});
  CHECK(sources[1].split == data::SampleSplit::Documents);
  CHECK(sources[2].task == "copyright");
  CHECK(sources[2].files ==
        std::vector<fs::path>{doc / "pkg-a/copyright", doc / "pkg-b/copyright"});
  CHECK(sources[3].task == "readme-debian");

  const auto tok = model::Tokenizer::synthetic(600, 3);
  const auto c = data::load_sources(sources, tok, 100000);
  CHECK(c.tasks == std::vector<std::string>{"fortunes/art", "common-licenses", "copyright",
                                            "readme-debian"});
  std::vector<int> per_task(4, 0);
  for (const auto& s : c.samples) ++per_task[static_cast<std::size_t>(s.task)];
  CHECK(per_task == std::vector<int>{3, 2, 2, 1});  // fortunes by '%', the rest a file each
  // The GPL-3 document is one sample: the whole text (its leading blank line dropped).
  const auto& gpl_sample = c.samples[4];
  CHECK(gpl_sample.task == 1);
  std::string body = gpl;
  body.erase(body.find_last_not_of('\n') + 1);
  CHECK(gpl_sample.tokens == tok.encode(body, true, false));
  // A real spread: the longest sample is many times the shortest.
  std::size_t shortest = SIZE_MAX, longest = 0;
  for (const auto& s : c.samples) {
    shortest = std::min(shortest, s.tokens.size());
    longest = std::max(longest, s.tokens.size());
  }
  CHECK(longest >= 30 * shortest);
  // Cut to max_tokens, counted.
  const auto cut = data::load_sources(sources, tok, 16);
  CHECK(cut.truncated_samples >= 1);
  CHECK(cut.samples[4].tokens.size() == 16);

  // A binary file among the documents is named; an empty root and sources without text too.
  std::ofstream(doc / "pkg-b/copyright", std::ios::binary) << std::string("PK\x03\x04", 4) << "zip";
  CHECK(test::error_of(Errc::BadFile, [&] {
          (void)data::load_sources(data::debian_sources(root), tok, 64);
        }).find("pkg-b/copyright: is") != std::string::npos);
  std::ofstream(doc / "pkg-b/copyright", std::ios::binary) << std::string("text\0more", 9);
  CHECK(test::error_of(Errc::BadFile, [&] {
          (void)data::load_sources(data::debian_sources(root), tok, 64);
        }).find("pkg-b/copyright: is a binary file") != std::string::npos);
  fs::create_directories(root / "empty");
  CHECK(test::error_of(Errc::BadFile, [&] { (void)data::debian_sources(root / "empty"); })
            .find("no Debian text found") != std::string::npos);
  std::ofstream(root / "blank") << "\n\n  \n";
  const std::vector<data::CorpusSource> blank{{"blank", {root / "blank"}, data::SampleSplit::Documents}};
  CHECK(test::error_of(Errc::BadFile, [&] { (void)data::load_sources(blank, tok, 64); })
            .find("the corpus of tasks blank: no text samples found") != std::string::npos);
  fs::remove_all(root);
}

TEST_CASE("corpus.debian: this machine's Debian text gives fortunes beside long licenses") {
  const auto sources = data::debian_sources();
  std::vector<data::CorpusSource> some;  // the fortunes and the licenses (the rest is large)
  for (const auto& s : sources)
    if (s.task == "common-licenses" || s.task == "fortunes/computers") some.push_back(s);
  REQUIRE(some.size() == 2);  // scripts/deps.sh installs fortunes; base-files the licenses
  CHECK(std::any_of(sources.begin(), sources.end(),
                    [](const auto& s) { return s.task == "copyright" && s.files.size() >= 50; }));
  const auto tok = model::Tokenizer::synthetic(600, 3);
  const auto c = data::load_sources(some, tok, 1 << 20);
  REQUIRE(c.tasks.size() == 2);
  std::vector<std::size_t> lengths[2];
  for (const auto& s : c.samples) lengths[s.task].push_back(s.tokens.size());
  for (auto& l : lengths) std::sort(l.begin(), l.end());
  const auto median = [](const std::vector<std::size_t>& l) { return l[l.size() / 2]; };
  CHECK(lengths[1].size() >= 10);               // the licenses, a document each
  CHECK(median(lengths[1]) >= 20 * median(lengths[0]));  // documents vs fortunes
}
