// brigade::schedule: the schedule IR. A schedule is data: per-rank lists of Actions plus the
// Shape they run on. Text form, parser and the step x rank grid live here too.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/core/op.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <compare>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace brigade::schedule {
inline namespace v0 {

/// The op of an action: the same enum the Timeline records (brigade::Op, core/op.hpp).
using Op = ::brigade::Op;

/// True for the compute ops (F, B, BI, BW, RECOMPUTE, SAMPLE, OPT): neither SEND/RECV nor the
/// memory ops PREFETCH, RELEASE, MIGRATE (brigade::is_compute, core/op.hpp).
using ::brigade::is_compute;

/// One step of one rank's program. Plain data: copyable, ordered, hashable by value, printable.
///
/// Text form (see to_string(const Action&)): `<virtual_stage><OP><microbatch>[.c<chunk>]`,
/// e.g. "3F7", "2SEND_B4", "5BW1.c2", "2PREFETCH0.c3". A PREFETCH or RELEASE acts on the
/// weights of its virtual stage; its micro-batch and chunk name the compute it is placed for
/// (the Timeline shows them) and do not change what it does.
struct Action {
  Op op = Op::F;                   ///< what to do
  std::int32_t virtual_stage = 0;  ///< global virtual-stage index in [0, shape.num_virtual_stages)
  std::int32_t microbatch = 0;     ///< in [0, shape.num_microbatches)
  /// In [0, shape.num_chunks). Training: the PACS/InfiniPipe chunk index (0 when unchunked).
  /// Inference (Mode::Inference): the round, 0 = prefill, r >= 1 = the r-th decode step.
  std::int32_t chunk = 0;
  friend constexpr auto operator<=>(const Action&, const Action&) = default;
};

/// What a schedule computes, which decides the dataflow edges between its actions.
///
/// - Training: F(v) feeds F(v+1); B/BI(v+1) feeds B/BI(v); F(v) precedes B/BI(v); BI(v)
///   precedes BW(v). Chunks of a micro-batch are independent units.
/// - Inference: forward only; `chunk` is the round (0 = prefill, then decode steps). F(v) feeds
///   F(v+1); the last virtual stage's SAMPLE of round c feeds F(0) of round c + 1 (the sampled
///   token returns to the first stage); F(v) of round c precedes F(v) of round c + 1 (KV cache).
enum class Mode : std::uint8_t { Training, Inference };

/// "training" or "inference".
constexpr std::string_view to_string(Mode m) noexcept {
  return m == Mode::Training ? "training" : "inference";
}

/// The dimensions of a schedule and where its virtual stages run.
///
/// Virtual stage v runs on rank `placement[v]`; make() uses the standard round-robin placement
/// v -> v mod num_ranks, so rank r holds virtual stages r, r + P, r + 2P, ... (interleaved 1F1B,
/// Narayanan et al. 2021 §2.2). The peer of every SEND/RECV follows from this placement.
struct Shape {
  int num_ranks = 1;           ///< P: workers, each running one program
  int num_virtual_stages = 1;  ///< N: pipeline stages in model order (P * V when interleaved)
  int num_microbatches = 1;    ///< M
  int num_chunks = 1;          ///< chunks per micro-batch (training) or rounds (inference)
  Mode mode = Mode::Training;
  std::vector<int> placement;  ///< placement[v] = rank of virtual stage v; size N

  /// Round-robin shape: P ranks, V virtual stages per rank (N = P * V), M micro-batches.
  /// @throws brigade::Error{InvalidArgument} if a count is < 1 (see check())
  static Shape make(int ranks, int microbatches, int virtual_per_rank = 1, int chunks = 1,
                    Mode mode = Mode::Training) {
    BRIGADE_CHECK(ranks >= 1 && virtual_per_rank >= 1, Errc::InvalidArgument,
                  "Shape: ranks = {} and virtual stages per rank = {}, expected both >= 1", ranks,
                  virtual_per_rank);
    BRIGADE_CHECK(static_cast<std::int64_t>(ranks) * virtual_per_rank <= (1 << 20),
                  Errc::InvalidArgument, "Shape: {} x {} virtual stages, expected at most 2^20",
                  ranks, virtual_per_rank);
    Shape s;
    s.num_ranks = ranks;
    s.num_virtual_stages = ranks * virtual_per_rank;
    s.num_microbatches = microbatches;
    s.num_chunks = chunks;
    s.mode = mode;
    s.placement.resize(static_cast<std::size_t>(s.num_virtual_stages));
    for (int v = 0; v < s.num_virtual_stages; ++v)
      s.placement[static_cast<std::size_t>(v)] = v % ranks;
    s.check();
    return s;
  }

  /// V-shaped shape (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §6 ZB-V; the
  /// "cut-in-half" DualPipeV of deepseek-ai/DualPipe): P ranks, two virtual stages per rank
  /// (N = 2P), virtual stages 0..P-1 on ranks 0..P-1, then P..2P-1 on ranks P-1..0, so rank r
  /// holds r and 2P-1-r. The model goes down the ranks and comes back up: the first and the last
  /// virtual stage share rank 0, and rank P-1 passes its forward to itself.
  /// @throws brigade::Error{InvalidArgument} if a count is < 1 (see check())
  static Shape make_v(int ranks, int microbatches, int chunks = 1, Mode mode = Mode::Training) {
    Shape s = make(ranks, microbatches, 2, chunks, mode);
    for (int v = ranks; v < s.num_virtual_stages; ++v)
      s.placement[static_cast<std::size_t>(v)] = 2 * ranks - 1 - v;
    s.check();
    return s;
  }

  /// Rank of virtual stage v (no range check; call check() first).
  [[nodiscard]] int rank_of(int v) const noexcept { return placement[static_cast<std::size_t>(v)]; }

  /// Number of virtual stages placed on rank r.
  [[nodiscard]] int stages_on(int r) const noexcept {
    return static_cast<int>(std::count(placement.begin(), placement.end(), r));
  }

  /// Checks the invariants: every count >= 1, placement has N entries in [0, P), every rank
  /// holds at least one virtual stage, and N * M * chunks <= 2^31 (the validator's tables).
  /// @throws brigade::Error{InvalidArgument} naming the field, the value seen and the expected one
  void check() const {
    BRIGADE_CHECK(num_ranks >= 1, Errc::InvalidArgument, "Shape: ranks = {}, expected >= 1",
                  num_ranks);
    BRIGADE_CHECK(num_virtual_stages >= num_ranks, Errc::InvalidArgument,
                  "Shape: stages = {}, expected >= ranks = {}", num_virtual_stages, num_ranks);
    BRIGADE_CHECK(num_microbatches >= 1, Errc::InvalidArgument,
                  "Shape: microbatches = {}, expected >= 1", num_microbatches);
    BRIGADE_CHECK(num_chunks >= 1, Errc::InvalidArgument, "Shape: chunks = {}, expected >= 1",
                  num_chunks);
    BRIGADE_CHECK(static_cast<std::int64_t>(num_virtual_stages) * num_microbatches * num_chunks <=
                      (std::int64_t{1} << 31),
                  Errc::InvalidArgument,
                  "Shape: stages x microbatches x chunks = {} x {} x {} exceeds 2^31",
                  num_virtual_stages, num_microbatches, num_chunks);
    BRIGADE_CHECK(placement.size() == static_cast<std::size_t>(num_virtual_stages),
                  Errc::InvalidArgument, "Shape: placement has {} entries, expected stages = {}",
                  placement.size(), num_virtual_stages);
    std::vector<bool> used(static_cast<std::size_t>(num_ranks), false);
    for (int v = 0; v < num_virtual_stages; ++v) {
      const int r = placement[static_cast<std::size_t>(v)];
      BRIGADE_CHECK(r >= 0 && r < num_ranks, Errc::InvalidArgument,
                    "Shape: placement of virtual stage {} is rank {}, expected in [0, {})", v, r,
                    num_ranks);
      used[static_cast<std::size_t>(r)] = true;
    }
    for (int r = 0; r < num_ranks; ++r)
      BRIGADE_CHECK(used[static_cast<std::size_t>(r)], Errc::InvalidArgument,
                    "Shape: rank {} holds no virtual stage", r);
  }

  friend bool operator==(const Shape&, const Shape&) = default;
};

/// Per-rank programs plus their shape. `ranks[r]` is rank r's program in issue order.
/// A generator's output is compute-only; lower() adds the SEND/RECV actions.
struct Schedule {
  Shape shape;
  std::vector<std::vector<Action>> ranks;  ///< ranks.size() == shape.num_ranks

  /// Total number of actions over all ranks.
  [[nodiscard]] std::size_t num_actions() const noexcept {
    std::size_t n = 0;
    for (const auto& p : ranks) n += p.size();
    return n;
  }
  friend bool operator==(const Schedule&, const Schedule&) = default;
};

/// A schedule of `shape` whose rank programs are all empty (shape.num_ranks of them), to fill
/// by hand.
inline Schedule empty_schedule(const Shape& shape) {
  Schedule s{shape, {}};
  s.ranks.resize(static_cast<std::size_t>(std::max(0, shape.num_ranks)));
  return s;
}

/// Text form of an action: `<virtual_stage><OP><microbatch>`, then `.c<chunk>` only when the
/// chunk is nonzero. OP is to_string(Op) ("F", "BI", "SEND_F", ...). Examples: "3F7",
/// "2SEND_B4", "5BW1.c2". parse_action() is its exact inverse.
inline std::string to_string(const Action& a) {
  std::string s = fmt::format("{}{}{}", a.virtual_stage, ::brigade::to_string(a.op), a.microbatch);
  if (a.chunk != 0) s += fmt::format(".c{}", a.chunk);
  return s;
}

namespace detail {

/// Result of parsing one action token: the action, or an error with the 0-based offset in the
/// token where it was found.
struct ActionParse {
  std::optional<Action> action;
  std::string error;
  std::size_t offset = 0;
};

inline std::string known_ops() {
  std::string s;
  for (int i = 0; i < kNumOps; ++i) {
    if (i) s += ", ";
    s += ::brigade::to_string(static_cast<Op>(i));
  }
  return s;
}

/// Parses a non-negative decimal int32 at s[pos...]; advances pos.
inline bool parse_index(std::string_view s, std::size_t& pos, std::int32_t& out) {
  const char* first = s.data() + pos;
  const char* last = s.data() + s.size();
  if (first == last || *first < '0' || *first > '9') return false;
  auto [ptr, ec] = std::from_chars(first, last, out);
  if (ec != std::errc{}) return false;
  pos += static_cast<std::size_t>(ptr - first);
  return true;
}

/// The grammar of to_string(Action): digits, an op name ([A-Z_]+, matched whole), digits,
/// optionally ".c" digits.
inline ActionParse parse_action_token(std::string_view tok) {
  ActionParse r;
  std::size_t pos = 0;
  Action a;
  if (!parse_index(tok, pos, a.virtual_stage)) {
    r.error = "expected a virtual-stage number (0..2^31-1) at the start";
    return r;
  }
  const std::size_t op_begin = pos;
  while (pos < tok.size() && ((tok[pos] >= 'A' && tok[pos] <= 'Z') || tok[pos] == '_')) ++pos;
  const std::string_view op_name = tok.substr(op_begin, pos - op_begin);
  if (op_name.empty()) {
    r.error = fmt::format("expected an op ({}) after the virtual stage", known_ops());
    r.offset = op_begin;
    return r;
  }
  const auto op = op_from_string(op_name);
  if (!op) {
    r.error = fmt::format("unknown op '{}', expected one of {}", ::brigade::detail::excerpt(op_name), known_ops());
    r.offset = op_begin;
    return r;
  }
  a.op = *op;
  const std::size_t mb_begin = pos;
  if (!parse_index(tok, pos, a.microbatch)) {
    r.error = "expected a micro-batch number (0..2^31-1) after the op";
    r.offset = mb_begin;
    return r;
  }
  if (pos < tok.size()) {
    const std::size_t suffix = pos;
    if (tok.substr(pos, 2) != ".c") {
      r.error = fmt::format("unexpected '{}' after the micro-batch, expected end or '.c<chunk>'",
                            ::brigade::detail::excerpt(tok.substr(pos)));
      r.offset = suffix;
      return r;
    }
    pos += 2;
    if (!parse_index(tok, pos, a.chunk)) {
      r.error = "expected a chunk number (0..2^31-1) after '.c'";
      r.offset = pos;
      return r;
    }
    if (pos != tok.size()) {
      r.error = fmt::format("unexpected '{}' after the chunk",
                            ::brigade::detail::excerpt(tok.substr(pos)));
      r.offset = pos;
      return r;
    }
  }
  r.action = a;
  return r;
}

}  // namespace detail

/// Parses the text form of one action (the exact inverse of to_string(const Action&); a
/// ".c0" suffix is accepted and means chunk 0).
/// @throws brigade::Error{InvalidArgument} naming the token, the column and what was expected
inline Action parse_action(std::string_view text) {
  auto r = detail::parse_action_token(text);
  if (!r.action)
    ::brigade::detail::fail(Errc::InvalidArgument, "action '{}', column {}: {}",
                            ::brigade::detail::excerpt(text), r.offset + 1,
                            r.error);
  return *r.action;
}

/// Text form of a schedule, one line per rank, which parse_schedule() reads back exactly:
///
///     # brigade schedule (text form v1): one line per rank, actions in issue order
///     shape ranks=2 stages=2 microbatches=2 chunks=1 mode=training placement=0,1
///     rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
///     rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1
inline std::string to_text(const Schedule& s) {
  std::string out =
      "# brigade schedule (text form v1): one line per rank, actions in issue order\n";
  out += fmt::format("shape ranks={} stages={} microbatches={} chunks={} mode={} placement=",
                     s.shape.num_ranks, s.shape.num_virtual_stages, s.shape.num_microbatches,
                     s.shape.num_chunks, to_string(s.shape.mode));
  for (std::size_t v = 0; v < s.shape.placement.size(); ++v)
    out += fmt::format("{}{}", v ? "," : "", s.shape.placement[v]);
  out += '\n';
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    out += fmt::format("rank {}:", r);
    for (const auto& a : s.ranks[r]) {
      out += ' ';
      out += to_string(a);
    }
    out += '\n';
  }
  return out;
}

namespace detail {

struct TextCursor {
  std::string_view line;
  int line_no = 0;
  std::size_t pos = 0;

  void skip_space() {
    while (pos < line.size() && (line[pos] == ' ' || line[pos] == '\t' || line[pos] == '\r')) ++pos;
  }
  /// Next whitespace-separated token; its 0-based start in `start`.
  std::string_view token(std::size_t& start) {
    skip_space();
    start = pos;
    while (pos < line.size() && line[pos] != ' ' && line[pos] != '\t' && line[pos] != '\r') ++pos;
    return line.substr(start, pos - start);
  }
};

template <class... Args>
[[noreturn]] void fail_at(int line, std::size_t col0, fmt::format_string<Args...> f,
                          Args&&... args) {
  ::brigade::detail::fail(Errc::InvalidArgument, "schedule text, line {}, column {}: {}", line,
                          col0 + 1, fmt::format(f, std::forward<Args>(args)...));
}

inline int parse_int_field(std::string_view value, int line, std::size_t col,
                           std::string_view key) {
  std::int32_t v = 0;
  std::size_t p = 0;
  if (!parse_index(value, p, v) || p != value.size())
    fail_at(line, col, "{}='{}' is not a non-negative integer", key,
            ::brigade::detail::excerpt(value));
  return v;
}

}  // namespace detail

/// Parses the text form written by to_text(). Grammar (one item per line; blank lines and
/// lines starting with '#' are ignored):
///
///     shape ranks=P microbatches=M [stages=N] [chunks=C] [mode=training|inference]
///           [placement=r0,r1,...,r(N-1)]
///     rank 0: ACTION ACTION ...
///     ...
///     rank P-1: ...
///
/// The shape line comes first; missing keys default to stages = P, chunks = 1,
/// mode = training and the round-robin placement v -> v mod P. Every rank 0..P-1 must appear
/// exactly once, in order. Each action's indices must lie inside the shape.
/// parse_schedule(to_text(s)) == s for every valid schedule s.
/// @throws brigade::Error{InvalidArgument} naming the line, the column and the token
inline Schedule parse_schedule(std::string_view text) {
  Schedule s;
  bool have_shape = false;
  int next_rank = 0;
  int line_no = 0;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    detail::TextCursor cur{text.substr(begin, end - begin), ++line_no, 0};
    begin = end + 1;
    cur.skip_space();
    if (cur.pos >= cur.line.size() || cur.line[cur.pos] == '#') {
      if (end == text.size()) break;
      continue;
    }
    std::size_t col = 0;
    const std::string_view head = cur.token(col);
    if (head == "shape") {
      if (have_shape) detail::fail_at(cur.line_no, col, "a second 'shape' line");
      int ranks = -1, stages = -1, mbs = -1, chunks = 1;
      Mode mode = Mode::Training;
      std::vector<int> placement;
      bool have_placement = false;
      for (;;) {
        const std::string_view kv = cur.token(col);
        if (kv.empty()) break;
        const auto eq = kv.find('=');
        if (eq == std::string_view::npos)
          detail::fail_at(cur.line_no, col, "expected key=value in the shape line, got '{}'",
                            ::brigade::detail::excerpt(kv));
        const std::string_view key = kv.substr(0, eq), value = kv.substr(eq + 1);
        const std::size_t vcol = col + eq + 1;
        if (key == "ranks") {
          ranks = detail::parse_int_field(value, cur.line_no, vcol, key);
        } else if (key == "stages") {
          stages = detail::parse_int_field(value, cur.line_no, vcol, key);
        } else if (key == "microbatches") {
          mbs = detail::parse_int_field(value, cur.line_no, vcol, key);
        } else if (key == "chunks") {
          chunks = detail::parse_int_field(value, cur.line_no, vcol, key);
        } else if (key == "mode") {
          if (value == "training") {
            mode = Mode::Training;
          } else if (value == "inference") {
            mode = Mode::Inference;
          } else {
            detail::fail_at(cur.line_no, vcol, "mode='{}', expected training or inference",
                            ::brigade::detail::excerpt(value));
          }
        } else if (key == "placement") {
          have_placement = true;
          std::size_t p = 0;
          while (p <= value.size()) {
            std::size_t q = value.find(',', p);
            if (q == std::string_view::npos) q = value.size();
            placement.push_back(
                detail::parse_int_field(value.substr(p, q - p), cur.line_no, vcol + p, key));
            p = q + 1;
          }
        } else {
          detail::fail_at(cur.line_no, col,
                          "unknown shape key '{}', expected ranks, stages, microbatches, chunks, "
                          "mode or placement",
                          ::brigade::detail::excerpt(key));
        }
      }
      if (ranks < 1) detail::fail_at(cur.line_no, 0, "the shape line needs ranks=P with P >= 1");
      if (mbs < 1)
        detail::fail_at(cur.line_no, 0, "the shape line needs microbatches=M with M >= 1");
      if (stages < 0) stages = have_placement ? static_cast<int>(placement.size()) : ranks;
      if (!have_placement) {
        if (stages < 1 || stages > (1 << 20))
          detail::fail_at(cur.line_no, 0, "stages={} outside [1, 2^20]", stages);
        for (int v = 0; v < stages; ++v) placement.push_back(v % ranks);
      }
      s.shape.num_ranks = ranks;
      s.shape.num_virtual_stages = stages;
      s.shape.num_microbatches = mbs;
      s.shape.num_chunks = chunks;
      s.shape.mode = mode;
      s.shape.placement = std::move(placement);
      try {
        s.shape.check();
      } catch (const Error& e) {
        detail::fail_at(cur.line_no, 0, "{}", e.what());
      }
      s.ranks.resize(static_cast<std::size_t>(ranks));
      have_shape = true;
    } else if (head == "rank") {
      if (!have_shape) detail::fail_at(cur.line_no, col, "a rank line before the 'shape' line");
      const std::string_view num = cur.token(col);
      if (num.empty() || num.back() != ':')
        detail::fail_at(cur.line_no, col, "expected 'rank <r>:', got 'rank {}'",
                        ::brigade::detail::excerpt(num));
      const int r =
          detail::parse_int_field(num.substr(0, num.size() - 1), cur.line_no, col, "rank");
      if (r != next_rank)
        detail::fail_at(cur.line_no, col,
                        "rank {} where rank {} was expected (ranks 0..{} in order)", r, next_rank,
                        s.shape.num_ranks - 1);
      if (r >= s.shape.num_ranks)
        detail::fail_at(cur.line_no, col, "rank {} but the shape has ranks={}", r,
                        s.shape.num_ranks);
      auto& prog = s.ranks[static_cast<std::size_t>(r)];
      for (;;) {
        const std::string_view tok = cur.token(col);
        if (tok.empty()) break;
        auto p = detail::parse_action_token(tok);
        if (!p.action)
          detail::fail_at(cur.line_no, col + p.offset, "action '{}': {}",
                          ::brigade::detail::excerpt(tok), p.error);
        const Action a = *p.action;
        if (a.virtual_stage >= s.shape.num_virtual_stages)
          detail::fail_at(cur.line_no, col, "action '{}': virtual stage {} outside [0, {})",
                          ::brigade::detail::excerpt(tok),
                          a.virtual_stage, s.shape.num_virtual_stages);
        if (a.microbatch >= s.shape.num_microbatches)
          detail::fail_at(cur.line_no, col, "action '{}': micro-batch {} outside [0, {})",
                          ::brigade::detail::excerpt(tok),
                          a.microbatch, s.shape.num_microbatches);
        if (a.chunk >= s.shape.num_chunks)
          detail::fail_at(cur.line_no, col, "action '{}': chunk {} outside [0, {})",
                          ::brigade::detail::excerpt(tok), a.chunk,
                          s.shape.num_chunks);
        prog.push_back(a);
      }
      ++next_rank;
    } else {
      detail::fail_at(cur.line_no, col, "expected 'shape' or 'rank <r>:', got '{}'",
                        ::brigade::detail::excerpt(head));
    }
    if (end == text.size()) break;
  }
  BRIGADE_CHECK(have_shape, Errc::InvalidArgument, "schedule text: no 'shape' line");
  BRIGADE_CHECK(next_rank == s.shape.num_ranks, Errc::InvalidArgument,
                "schedule text: {} rank lines, expected ranks={} (rank {} is missing)", next_rank,
                s.shape.num_ranks, next_rank);
  return s;
}

/// A cell of the step x rank grid: the `index`-th action of rank `rank`'s program.
struct Step {
  int rank = 0;
  int index = 0;
  friend constexpr auto operator<=>(const Step&, const Step&) = default;
};

/// Options of render_grid().
struct GridOptions {
  std::vector<Step> marks;  ///< cells to mark (shown as [action] with "<-- rank r" at row end)
  int context = -1;         ///< rows shown around each mark; < 0 shows every row
  std::vector<int> ranks;   ///< columns to show, in this order; empty shows every rank
};

/// Step x rank table of a schedule: row i shows the i-th action of every rank's program
/// ("." where a program is shorter). Marked cells are bracketed and the row names the rank;
/// with `context >= 0` only rows within `context` of a mark are shown, gaps as "...".
inline std::string render_grid(const Schedule& s, const GridOptions& opt = {}) {
  std::vector<int> cols = opt.ranks;
  if (cols.empty())
    for (int r = 0; r < static_cast<int>(s.ranks.size()); ++r) cols.push_back(r);
  std::size_t rows = 0;
  for (int r : cols)
    if (r >= 0 && r < static_cast<int>(s.ranks.size()))
      rows = std::max(rows, s.ranks[static_cast<std::size_t>(r)].size());
  std::vector<bool> show(rows, opt.context < 0 || opt.marks.empty());
  if (opt.context >= 0)
    for (const auto& m : opt.marks)
      for (int i = m.index - opt.context; i <= m.index + opt.context; ++i)
        if (i >= 0 && static_cast<std::size_t>(i) < rows) show[static_cast<std::size_t>(i)] = true;
  auto is_marked = [&](int r, std::size_t i) {
    return std::any_of(opt.marks.begin(), opt.marks.end(), [&](const Step& m) {
      return m.rank == r && m.index == static_cast<int>(i);
    });
  };
  auto cell = [&](int r, std::size_t i) -> std::string {
    if (r < 0 || r >= static_cast<int>(s.ranks.size())) return "?";
    const auto& p = s.ranks[static_cast<std::size_t>(r)];
    std::string c = i < p.size() ? to_string(p[i]) : std::string(".");
    return is_marked(r, i) ? fmt::format("[{}]", c) : c;
  };
  std::vector<std::size_t> width;
  for (int r : cols) {
    std::size_t w = fmt::format("rank {}", r).size();
    for (std::size_t i = 0; i < rows; ++i)
      if (show[i]) w = std::max(w, cell(r, i).size());
    width.push_back(w);
  }
  const std::size_t step_w = std::max<std::size_t>(4, fmt::format("{}", rows).size());
  std::string out = fmt::format("{:>{}}", "step", step_w);
  for (std::size_t c = 0; c < cols.size(); ++c)
    out += fmt::format("  {:<{}}", fmt::format("rank {}", cols[c]), width[c]);
  while (!out.empty() && out.back() == ' ') out.pop_back();
  out += '\n';
  bool gap = false;
  for (std::size_t i = 0; i < rows; ++i) {
    if (!show[i]) {
      if (!gap) out += fmt::format("{:>{}}\n", "...", step_w);
      gap = true;
      continue;
    }
    gap = false;
    std::string line = fmt::format("{:>{}}", i, step_w);
    std::string note;
    for (std::size_t c = 0; c < cols.size(); ++c) {
      line += fmt::format("  {:<{}}", cell(cols[c], i), width[c]);
      if (is_marked(cols[c], i))
        note += fmt::format("{}rank {}", note.empty() ? "" : ", ", cols[c]);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    if (!note.empty()) line += fmt::format("   <-- {}", note);
    out += line + '\n';
  }
  return out;
}

}  // namespace v0
}  // namespace brigade::schedule
