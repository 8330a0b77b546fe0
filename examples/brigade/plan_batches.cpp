// `brigade plan-batches`: one global batch's samples (a lengths file or a corpus) through a
// batcher of the batching joint; prints the micro-batches, each one's predicted seconds per
// stage, activation bytes and recompute mode, and the pipeline's predicted iteration time.
#include "cli.hpp"
#include "model_config.hpp"

#include <brigade/batching/batcher.hpp>
#include <brigade/batching/dynamic.hpp>
#include <brigade/batching/order.hpp>
#include <brigade/core/error.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/data/corpus.hpp>
#include <brigade/io/input.hpp>
#include <brigade/model/config.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/schedule/generators.hpp>
#include <brigade/schedule/lower.hpp>
#include <brigade/schedule/recompute.hpp>
#include <brigade/sim/simulator.hpp>
#include <brigade/sim/svg.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <charconv>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace brigade;

struct Options {
  std::string lengths, corpus, tokenizer, profile, model = "1.1B", batching = "dynamic", svg;
  int vocab_size = 512, stages = 4, samples_per_microbatch = 8, row_tokens = 0;
  std::int64_t token_budget = 0;
  double memory_limit = 0.0, rank_memory = 0.0;
  bool histogram = false;
  std::string recompute = "auto";
};

/// The corpus's length histogram, per task and over all: samples, tokens, the shortest,
/// median, 90th percentile and longest sample (tokens, BOS included), and the samples in each
/// bucket of lengths (powers of 4 from 16 tokens).
std::string length_histogram(const data::Corpus& corpus) {
  constexpr std::int64_t kEdges[] = {16, 64, 256, 1024, 4096};
  auto row = [&](std::string name, std::vector<std::int64_t> l) {
    std::sort(l.begin(), l.end());
    std::int64_t total = 0;
    std::array<std::int64_t, std::size(kEdges) + 1> buckets{};
    for (const auto n : l) {
      total += n;
      std::size_t b = 0;
      while (b < std::size(kEdges) && n > kEdges[b]) ++b;
      ++buckets[b];
    }
    const auto at = [&](double q) { return l[static_cast<std::size_t>(q * static_cast<double>(l.size() - 1))]; };
    std::string out = fmt::format("{:<28} {:>7} {:>9} {:>6} {:>6} {:>6} {:>6} ", name, l.size(),
                                  total, l.front(), at(0.5), at(0.9), l.back());
    for (const auto b : buckets) out += fmt::format(" {:>7}", b);
    return out + "\n";
  };
  std::string out = fmt::format("{:<28} {:>7} {:>9} {:>6} {:>6} {:>6} {:>6}  {:>7} {:>7} {:>7} {:>7} {:>7} {:>7}\n",
                                "task", "samples", "tokens", "min", "median", "p90", "max",
                                "<=16", "17-64", "65-256", "257-1K", "1K-4K", ">4K");
  std::vector<std::vector<std::int64_t>> per(corpus.tasks.size());
  std::vector<std::int64_t> all;
  for (const auto& s : corpus.samples) {
    per[static_cast<std::size_t>(s.task)].push_back(static_cast<std::int64_t>(s.tokens.size()));
    all.push_back(static_cast<std::int64_t>(s.tokens.size()));
  }
  for (std::size_t t = 0; t < per.size(); ++t) out += row(corpus.tasks[t], per[t]);
  return out + row(fmt::format("all {} tasks", corpus.tasks.size()), all);
}

/// One length per line (blank lines skipped); errors name the file and the line.
std::vector<batching::SampleLength> read_lengths(const std::string& path) {
  const std::string text = io::read_input_file(path, "lengths file", io::kMaxPromptFileBytes);
  if (const auto other = io::foreign_format(std::string_view(text).substr(0, 16)))
    detail::fail(Errc::BadFile, "{}: is {}, not a lengths file (one token count per line)", path,
                 *other);
  if (const auto nul = text.find('\0'); nul != std::string::npos)
    detail::fail(Errc::BadFile,
                 "{}: is a binary file, not a lengths file (a NUL byte at offset {}; expected "
                 "one token count per line)",
                 path, nul);
  std::vector<batching::SampleLength> out;
  std::size_t start = 0;
  for (int line = 1; start < text.size(); ++line) {
    auto end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string_view l(text.data() + start, end - start);
    start = end + 1;
    while (!l.empty() && (l.back() == '\r' || l.back() == ' ' || l.back() == '\t')) l.remove_suffix(1);
    while (!l.empty() && (l.front() == ' ' || l.front() == '\t')) l.remove_prefix(1);
    if (l.empty()) continue;
    std::int64_t v = 0;
    const auto [p, ec] = std::from_chars(l.data(), l.data() + l.size(), v);
    BRIGADE_CHECK(ec == std::errc() && p == l.data() + l.size() && v >= 1, Errc::BadFile,
                  "{}:{}: '{}' is not a token count (a whole number >= 1)", path, line,
                  detail::excerpt(l));
    out.push_back({v, 0, static_cast<std::int64_t>(out.size())});
  }
  BRIGADE_CHECK(!out.empty(), Errc::BadFile, "{}: no lengths (expected one token count per line)",
                path);
  return out;
}

int run(const Options& o) {
  const model::ModelSpec spec(cli::load_model_config(o.model));
  const int row = o.row_tokens > 0 ? o.row_tokens : spec.config().seq_len;
  const std::int64_t budget = o.token_budget > 0 ? o.token_budget : 4 * std::int64_t{row};
  std::vector<batching::SampleLength> samples;
  std::string source;
  if (!o.lengths.empty()) {
    samples = read_lengths(o.lengths);
    source = o.lengths;
  } else {
    const auto tok = model::Tokenizer::load_llama2c(o.tokenizer, o.vocab_size);
    const auto corpus = cli::load_text_corpus(o.corpus, tok, static_cast<int>(budget) + 1);
    if (o.histogram) {
      fmt::print("{}: {} tasks, {} samples ({} cut to {} tokens, {} tokens dropped)\n{}", o.corpus,
                 corpus.tasks.size(), corpus.samples.size(), corpus.truncated_samples, budget + 1,
                 corpus.truncated_tokens, length_histogram(corpus));
      return 0;
    }
    for (const auto& s : corpus.samples)  // n tokens give n - 1 training rows
      samples.push_back({static_cast<std::int64_t>(s.tokens.size()) - 1, s.task,
                         static_cast<std::int64_t>(samples.size())});
    source = fmt::format("{} ({} tasks; {} samples cut to {} tokens)", o.corpus,
                         corpus.tasks.size(), corpus.truncated_samples, budget + 1);
  }
  const auto partition = partition::uniform(spec, o.stages);
  const auto cost = batching::stage_cost(
      spec, partition,
      o.profile.empty() ? model::roofline_layer_seconds()
                        : model::LayerSeconds(cost::ProfiledLayerTimes(cost::load_profile(o.profile))));
  const double limit = o.memory_limit > 0.0
                           ? o.memory_limit
                           : cost.activation_bytes(batching::varlen_work(
                                 budget, 1, batching::causal_pairs(budget)));
  batching::DynamicOptions opt;
  opt.recompute = o.recompute == "auto";
  opt.peak_limit_bytes = o.rank_memory > 0.0 ? o.rank_memory : o.stages * limit;
  std::vector<batching::MicroBatch> mbs;
  batching::MicroBatchTable table;  // each micro-batch's seconds, bytes and mode
  std::vector<char> over;           // static batchers without --memory-limit: over the limit
  if (o.batching == "dynamic") {
    auto plan = batching::DynamicBatcher(cost, o.stages, limit, opt).solve(samples);
    mbs = std::move(plan.microbatches);
    table = std::move(plan.costs);
    over.assign(mbs.size(), 0);
  } else {
    if (o.batching == "padding") {
      mbs = batching::PaddingBatcher{o.samples_per_microbatch}.plan(samples);
    } else if (o.batching == "packing") {
      mbs = batching::PackingBatcher{row, static_cast<int>(std::max<std::int64_t>(1, budget / row))}
                .plan(samples);
    } else {
      mbs = batching::OffsetsBatcher{budget}.plan(samples);
    }
    for (std::size_t m = 0; m < mbs.size(); ++m) {
      batching::MicroBatchChoice c;
      if (o.memory_limit > 0.0) {  // an explicit cap holds every batcher (choose_recompute)
        c = batching::choose_recompute(cost, mbs[m].work, limit, opt);
        BRIGADE_CHECK(c.fits, Errc::InvalidArgument,
                      "plan-batches: {} micro-batch {} ({} tokens) needs {} bytes of activations "
                      "on a stage, more than --memory-limit {} bytes{}",
                      o.batching, m, mbs[m].work.tokens, c.activation_bytes, limit,
                      opt.recompute
                          ? fmt::format(", and with full recompute it keeps {} bytes and peaks "
                                        "at {} (peak limit {} bytes)",
                                        c.checkpoint_bytes, c.activation_bytes,
                                        opt.peak_limit_bytes)
                          : std::string(" (--recompute none)"));
      } else {  // no cap given: as it is, flagged where it is over the default limit
        c.fits = true;
        c.seconds = cost.seconds(mbs[m].work);
        c.activation_bytes = cost.activation_bytes(mbs[m].work);
      }
      table.push_back(c);
      over.push_back(c.activation_bytes > limit && c.mode == batching::Recompute::None ? 1 : 0);
    }
  }
  std::int64_t tokens = 0, useful = 0;
  for (const auto& mb : mbs) {
    tokens += mb.work.tokens;
    useful += mb.useful_tokens;
  }
  fmt::print("plan-batches: {} samples, {} tokens from {}\n", samples.size(), useful, source);
  fmt::print("model {} on {} uniform stages, {} layer times; batching {}; memory limit {:.4g} "
             "bytes of activations per micro-batch on a stage (held from its forward to its "
             "backward); recompute {}\n",
             o.model, o.stages, o.profile.empty() ? "roofline" : o.profile, o.batching, limit,
             o.recompute);
  fmt::print("{:>4} {:>8} {:>8} {:>8} {:>8} {:>8} {:>12} {:>14} {:>14} {:>9}\n", "mb", "samples",
             "tokens", "useful", "padding", "longest", "seconds", "activation B", "held B",
             "recompute");
  double peak = 0.0;
  std::int64_t recomputed = 0;
  for (std::size_t m = 0; m < mbs.size(); ++m) {
    const auto& mb = mbs[m];
    const double t = table.seconds[m], b = table.peak_bytes[m];
    peak = std::max(peak, b);
    recomputed += table.recompute[m];
    fmt::print("{:>4} {:>8} {:>8} {:>8} {:>8} {:>8} {:>12.6g} {:>14.6g} {:>14.6g} {:>9}{}\n", m,
               mb.samples.size(), mb.work.tokens, mb.useful_tokens, mb.padding_tokens(),
               mb.longest, t, b, table.held_bytes[m],
               batching::to_string(table.recompute[m] != 0 ? batching::Recompute::Full
                                                           : batching::Recompute::None),
               over[m] != 0 ? "  over the limit" : "");
  }
  fmt::print("micro-batches {}; tokens {} ({} padding, {:.1f}%); {} recompute\n", mbs.size(),
             tokens, tokens - useful,
             100.0 * static_cast<double>(tokens - useful) / static_cast<double>(tokens), recomputed);
  fmt::print("predicted iteration {:.6g} s ((S - 1) x slowest + sum over micro-batches, "
             "recomputing ones with their second forward)\n",
             batching::predicted_iteration_seconds(table.seconds, o.stages));
  fmt::print("peak activation {:.6g} bytes (one micro-batch on the worst stage)\n", peak);
  // The schedule: DynaPipe's adaptive order under a rank's memory limit, simulated beside 1F1B
  // on the same micro-batches (MicroBatchTableCost: each micro-batch's stage seconds and bytes,
  // a RECOMPUTE before the backward of those that recompute).
  const double rank_limit =
      o.rank_memory > 0.0
          ? o.rank_memory
          : std::max(o.stages * limit, *std::max_element(table.peak_bytes.begin(),
                                                         table.peak_bytes.end()));
  const auto adaptive = batching::order_adaptive(table, o.stages, rank_limit);
  std::string order;
  for (const int m : adaptive.order) order += fmt::format("{}{}", order.empty() ? "" : " ", m);
  fmt::print("schedule by DynaPipe's ordering (section 5), at most {:.4g} bytes of activations "
             "per rank: {} in the order {}; simulated iteration {:.6g} s ({} orders tried; the "
             "adaptive schedule in the input order {:.6g} s)\n",
             rank_limit, adaptive.generator, order, adaptive.makespan_seconds,
             adaptive.orders_tried, adaptive.input_order_makespan_seconds);
  const auto chosen = sim::simulate(schedule::lower(adaptive.schedule),
                                    batching::MicroBatchTableCost(table.permuted(adaptive.order),
                                                                  1.0 / 3.0));
  std::string peaks;
  for (const double b : chosen.peak_memory_bytes)
    peaks += fmt::format("{}{:.4g}", peaks.empty() ? "" : " ", b);
  fmt::print("peak activation bytes per rank under that schedule: {}\n", peaks);
  if (!o.svg.empty()) {
    sim::SvgOptions so;
    so.title = fmt::format("plan-batches {}: {} on {} stages, {} micro-batches, {:.4g} s",
                           o.batching, adaptive.generator, o.stages, mbs.size(), chosen.makespan);
    sim::write_svg(o.svg, chosen.timeline, so);
  }
  sim::SimOptions sopt;
  sopt.record_timeline = false;
  const auto ofob = sim::simulate(
      schedule::lower(schedule::with_recompute(
          schedule::one_f_one_b({o.stages, static_cast<int>(mbs.size())}),
          table.any_recompute() ? std::span<const char>(table.recompute) : std::span<const char>())),
      batching::MicroBatchTableCost(table, 1.0 / 3.0), sopt);
  fmt::print("1f1b on the same micro-batches: simulated iteration {:.6g} s, peak {:.4g} bytes of "
             "activations on rank 0\n",
             ofob.makespan, ofob.peak_memory_bytes.front());
  return 0;
}

std::function<int()> setup(CLI::App& sub) {
  auto o = std::make_shared<Options>();
  auto* lengths = sub.add_option("lengths", o->lengths,
                                 "A lengths file: one sample's token count per line");
  auto* corpus = sub.add_option("--corpus", o->corpus,
                                "A text file or folder (one task per file), or 'debian' (the "
                                "multi-task corpus of Debian's plain text), tokenized with "
                                "--tokenizer; each sample counts its tokens - 1 rows");
  auto* tok = sub.add_option("--tokenizer", o->tokenizer, "llama2.c tokenizer for --corpus");
  sub.add_option("--vocab-size", o->vocab_size, "The tokenizer's vocabulary size")
      ->check(cli::number_in<int>(1, 1 << 24, "a whole number from 1 to 16777216"))
      ->capture_default_str();
  lengths->excludes(corpus);
  corpus->needs(tok);
  sub.add_option("--batching", o->batching, "padding, packing (Megatron/T5 rows), offsets, dynamic")
      ->check(CLI::IsMember({"padding", "packing", "offsets", "dynamic"}))
      ->capture_default_str();
  sub.add_option("--model", o->model, "A named model size or a JSON file of LlamaConfig fields (the cost model's shapes)")
      ->capture_default_str();
  sub.add_option("--stages", o->stages, "Pipeline stages S (uniform split)")
      ->check(cli::number_in<int>(1, 4096, "a whole number from 1 to 4096"))
      ->capture_default_str();
  sub.add_option("--profile", o->profile,
                 "A device profile for the layer times (docs/profiles.md); default: the roofline");
  sub.add_option("--token-budget", o->token_budget,
                 "Tokens per micro-batch for offsets and packing (default 4 x the row); the "
                 "default memory limit is one sequence of this many tokens")
      ->check(cli::number_in<std::int64_t>(1, std::int64_t{1} << 40, "a whole number from 1 to 2^40"));
  sub.add_option("--row-tokens", o->row_tokens, "Packing: tokens per row (default: the model's seq_len)")
      ->check(cli::number_in<int>(1, 1 << 24, "a whole number from 1 to 16777216"));
  sub.add_option("--samples-per-microbatch", o->samples_per_microbatch, "Padding: samples per micro-batch")
      ->check(cli::number_in<int>(1, 1 << 24, "a whole number from 1 to 16777216"))
      ->capture_default_str();
  sub.add_option("--memory-limit", o->memory_limit,
                 "Bytes of activations one micro-batch may keep on a stage from its forward to "
                 "its backward (default: one --token-budget sequence's; dynamic's DP limit). "
                 "Given, it holds every batcher: a micro-batch over it recomputes (full) where "
                 "its stage input fits, else it is an error")
      ->check(cli::number_in<double>(0, 1e18, "a number of bytes above 0", true));
  sub.add_option("--svg", o->svg, "Write the chosen schedule's simulated timeline as SVG");
  sub.add_flag("--histogram", o->histogram,
               "With --corpus: print the length histogram of its samples per task (tokens; "
               "samples cut to --token-budget + 1) and stop")
      ->needs(corpus);
  sub.add_option("--rank-memory", o->rank_memory,
                 "The adaptive schedule: activation bytes one rank may hold at once, and a "
                 "recomputing micro-batch's peak limit (default: stages x the micro-batch memory "
                 "limit; for the schedule, the largest micro-batch's bytes if more)")
      ->check(cli::number_in<double>(0, 1e18, "a number of bytes above 0", true));
  sub.add_option("--recompute", o->recompute,
                 "auto: a micro-batch whose activations do not fit --memory-limit recomputes its "
                 "stage's forward before the backward (DynaPipe's choice per micro-batch, priced "
                 "in the DP); none: it may not")
      ->check(CLI::IsMember({"auto", "none"}))
      ->capture_default_str();
  return [o, lengths, corpus] {
    BRIGADE_CHECK(lengths->count() + corpus->count() > 0, Errc::InvalidArgument,
                  "plan-batches: give a lengths file or --corpus");
    return run(*o);
  };
}

const cli::Registrar registrar{
    {"plan-batches",
     "Split a global batch into micro-batches (padding, packing, offsets, DynaPipe's dynamic DP) "
     "and predict the iteration time",
     setup}};

}  // namespace
