// validate(): symbolic execution of a lowered schedule. It proves that every rank's program
// runs to the end, or names what stops it: the wait-for cycle of a deadlock, a receive whose
// send does not exist, a backward before its forward, a micro-batch missing on a stage.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/schedule/action.hpp"
#include "brigade/schedule/dataflow.hpp"
#include "brigade/schedule/lower.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::schedule {
inline namespace v0 {

/// How a transport completes a send.
enum class SendSemantics : std::uint8_t {
  /// A send completes without its receive (buffered; in-process, small MPI messages).
  Eager,
  /// A send completes only once its receive has been posted (large MPI or NCCL messages).
  Rendezvous,
};

/// The executor's receive and send windows (engine::execute; engine::ExecutorWindows is this
/// type): RECV actions are posted in program order at most `recv_window` ahead of the one being
/// waited on; at most `send_window` sends are in flight before the oldest is waited on.
struct Windows {
  int recv_window = 4;  ///< >= 1
  int send_window = 8;  ///< >= 1
};

/// The execution semantics validate() checks a schedule against: the executor's matching rule
/// (receives of one channel match sends in order), its windows, and the transport's sends.
struct ExecutionModel {
  SendSemantics sends = SendSemantics::Eager;
  Windows windows{};  ///< used by the Rendezvous check (with eager sends they cannot block)
};

/// One line naming the semantics `m` stands for, as validate() and `brigade simulate` print it.
inline std::string describe(const ExecutionModel& m) {
  if (m.sends == SendSemantics::Eager)
    return "eager sends, receives matched in order per (peer, tag)";
  return fmt::format(
      "rendezvous sends (a send completes when its receive is posted), receives matched in order "
      "per (peer, tag), receive window {}, send window {}",
      m.windows.recv_window, m.windows.send_window);
}

/// What validate() proved about a schedule that completes.
struct ValidationResult {
  std::size_t actions = 0;          ///< actions over all ranks
  std::size_t compute_actions = 0;  ///< of which compute (is_compute: F, B, BI, BW, ...)
  std::size_t weight_actions = 0;   ///< of which PREFETCH or RELEASE
  std::size_t messages = 0;         ///< SEND/RECV pairs matched
  std::size_t migrations = 0;       ///< MIGRATE/MIGRATE_RECV pairs matched
  bool has_backward = false;        ///< whether the schedule holds B/BI/BW actions
  std::string semantics;            ///< describe() of the ExecutionModel it was checked under
};

/// The message channel of a communication action, as the executor's workers tag them:
/// 0 = activations (SEND_F/RECV_F between consecutive virtual stages), 1 = gradients
/// (SEND_B/RECV_B), 2 = the inference token edge (last virtual stage -> virtual stage 0),
/// 3 = layer migrations (MIGRATE/MIGRATE_RECV between neighbouring virtual stages).
/// Messages between two ranks on one channel are received in the order they were sent.
inline int channel_of(const Shape& shape, const Action& a) noexcept {
  if (a.op == Op::SendB || a.op == Op::RecvB) return 1;
  if (is_migration(a.op)) return 3;
  const bool token = shape.mode == Mode::Inference &&
                     ((a.op == Op::SendF && a.virtual_stage == shape.num_virtual_stages - 1) ||
                      (a.op == Op::RecvF && a.virtual_stage == 0));
  return token ? 2 : 0;
}

namespace detail {

/// Per-(virtual stage, micro-batch, chunk) flags of the symbolic run.
enum KeyBits : std::uint32_t {
  kSeenF = 1u << 0,
  kSeenB = 1u << 1,
  kSeenBI = 1u << 2,
  kSeenBW = 1u << 3,
  kSeenSample = 1u << 4,
  kSeenRecompute = 1u << 5,
  kSeenSendF = 1u << 6,
  kSeenRecvF = 1u << 7,
  kSeenSendB = 1u << 8,
  kSeenRecvB = 1u << 9,
  kDoneF = 1u << 10,
  kDoneBI = 1u << 11 /* B or BI */,
  kDoneW = 1u << 12 /* B or BW */,
  kDoneSample = 1u << 13,
  kDoneRecvF = 1u << 14,
  kDoneRecvB = 1u << 15,
  kPostedF = 1u << 16 /* on the receiver's key */,
  kPostedB = 1u << 17,
  kSeenMigrate = 1u << 18,
  kSeenMigrateRecv = 1u << 19,
  kPostedM = 1u << 20 /* on the MIGRATE_RECV's key */,
  kDoneRecvM = 1u << 21,
};

inline std::uint32_t seen_bit(Op op) noexcept {
  switch (op) {
    case Op::F:
      return kSeenF;
    case Op::B:
      return kSeenB;
    case Op::BI:
      return kSeenBI;
    case Op::BW:
      return kSeenBW;
    case Op::Sample:
      return kSeenSample;
    case Op::Recompute:
      return kSeenRecompute;
    case Op::SendF:
      return kSeenSendF;
    case Op::RecvF:
      return kSeenRecvF;
    case Op::SendB:
      return kSeenSendB;
    case Op::RecvB:
      return kSeenRecvB;
    case Op::Migrate:
      return kSeenMigrate;
    case Op::MigrateRecv:
      return kSeenMigrateRecv;
    case Op::Opt:
    case Op::Prefetch:
    case Op::Release:
      return 0;
  }
  return 0;
}

/// The posted and done bits of a receive (RECV_F, RECV_B, MIGRATE_RECV) on its own key.
inline std::uint32_t posted_bit(Op op) noexcept {
  return op == Op::RecvF ? kPostedF : op == Op::RecvB ? kPostedB : kPostedM;
}
inline std::uint32_t done_bit(Op op) noexcept {
  return op == Op::RecvF ? kDoneRecvF : op == Op::RecvB ? kDoneRecvB : kDoneRecvM;
}
inline bool is_receive(Op op) noexcept {
  return op == Op::RecvF || op == Op::RecvB || op == Op::MigrateRecv;
}
inline bool is_send(Op op) noexcept {
  return op == Op::SendF || op == Op::SendB || op == Op::Migrate;
}



/// Where a SEND sits: rank and step; rank < 0 when absent.
struct Where {
  std::int32_t rank = -1;
  std::int32_t index = -1;
};

class Validator {
 public:
  Validator(const Schedule& s, const ExecutionModel& model) : s_(s), sh_(s.shape), model_(model) {
    check_program_shape(s, "validate");
    BRIGADE_CHECK(model.windows.recv_window >= 1 && model.windows.send_window >= 1,
                  Errc::InvalidArgument,
                  "validate: receive window {} and send window {}, expected both >= 1",
                  model.windows.recv_window, model.windows.send_window);
    n_ = sh_.num_virtual_stages;
    m_ = sh_.num_microbatches;
    c_ = sh_.num_chunks;
    const std::int64_t keys = static_cast<std::int64_t>(n_) * m_ * c_;
    BRIGADE_CHECK(
        keys <= (std::int64_t{1} << 25), Errc::InvalidArgument,
        "validate: stages x micro-batches x chunks = {} exceeds the validator's limit 2^25", keys);
    bits_.assign(static_cast<std::size_t>(keys), 0);
    send_f_.assign(static_cast<std::size_t>(keys), Where{});
    send_b_.assign(static_cast<std::size_t>(keys), Where{});
    send_m_.assign(static_cast<std::size_t>(keys), Where{});
    migrate_peer_.assign(static_cast<std::size_t>(keys), -1);
    weights_.assign(static_cast<std::size_t>(n_), WeightState{});
  }

  ValidationResult run() {
    static_pass();
    if (model_.sends == SendSemantics::Eager)
      dynamic_pass();
    else
      rendezvous_pass();
    order_pass();
    result_.semantics = describe(model_);
    return result_;
  }

 private:
  [[nodiscard]] std::size_t key(const Action& a) const noexcept {
    return static_cast<std::size_t>(
        (static_cast<std::int64_t>(a.virtual_stage) * m_ + a.microbatch) * c_ + a.chunk);
  }
  [[nodiscard]] std::size_t key(int v, int m, int c) const noexcept {
    return key(Action{Op::F, v, m, c});
  }

  [[nodiscard]] const Action& at(int r, std::size_t i) const {
    return s_.ranks[static_cast<std::size_t>(r)][i];
  }

  /// Throws `code` with `msg` followed by the grid excerpt around `marks`.
  [[noreturn]] void fail_grid(Errc code, std::string msg, std::vector<Step> marks) const {
    GridOptions g;
    g.marks = marks;
    g.context = 3;
    for (const auto& m : marks)
      if (std::find(g.ranks.begin(), g.ranks.end(), m.rank) == g.ranks.end())
        g.ranks.push_back(m.rank);
    std::sort(g.ranks.begin(), g.ranks.end());
    if (g.ranks.size() > 8) g.ranks.resize(8);
    msg += '\n';
    msg += render_grid(s_, g);
    throw Error(code, msg);
  }

  // ---- static pass: ranges, placement, pairing, duplicates, completeness ------------------
  void static_pass() {
    for (int r = 0; r < sh_.num_ranks; ++r) {
      const auto& prog = s_.ranks[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < prog.size(); ++i) {
        const Action& a = prog[i];
        ++result_.actions;
        check_action_range(sh_, a, r, i, "validate");
        const std::size_t k = key(a);
        if (is_communication(a.op)) {
          const auto peer = counterpart(sh_, a);
          if (!peer)
            fail_grid(Errc::InvalidArgument,
                      fmt::format("validate: rank {} step {}: {} has no counterpart in a {} "
                                  "schedule of {} virtual stages (nothing to send to or receive "
                                  "from)",
                                  r, i, to_string(a), to_string(sh_.mode), n_),
                      {{r, static_cast<int>(i)}});
          if (sh_.rank_of(peer->virtual_stage) == r)
            fail_grid(Errc::InvalidArgument,
                      fmt::format("validate: rank {} step {}: {} pairs with {} on the same rank; "
                                  "edges within a rank need no communication",
                                  r, i, to_string(a), to_string(*peer)),
                      {{r, static_cast<int>(i)}});
          if (a.op == Op::SendF || a.op == Op::SendB) {
            auto& where = (a.op == Op::SendF ? send_f_ : send_b_)[key(*peer)];
            where = {r, static_cast<std::int32_t>(i)};
          }
        } else if (is_migration(a.op)) {
          if (sh_.mode == Mode::Training)
            fail_grid(Errc::InvalidArgument,
                      fmt::format("validate: rank {} step {}: {} in a training schedule: a layer "
                                  "migration moves an inference stage's weights and KV cache "
                                  "(DynaPipe); training stages do not migrate",
                                  r, i, to_string(a)),
                      {{r, static_cast<int>(i)}});
        } else if (is_memory_op(a.op)) {
          weight_step(r, i, a);
        } else {
          ++result_.compute_actions;
          if (a.op == Op::B || a.op == Op::BI || a.op == Op::BW) result_.has_backward = true;
          if (a.op == Op::Sample && a.virtual_stage != n_ - 1)
            fail_grid(Errc::InvalidArgument,
                      fmt::format("validate: rank {} step {}: {} samples on virtual stage {}, but "
                                  "only the last virtual stage ({}) samples",
                                  r, i, to_string(a), a.virtual_stage, n_ - 1),
                      {{r, static_cast<int>(i)}});
        }
        const std::uint32_t bit = seen_bit(a.op);
        if (bit != 0) {
          if (bits_[k] & bit)
            fail_grid(
                Errc::InvalidArgument,
                fmt::format("validate: rank {} step {}: {} appears twice", r, i, to_string(a)),
                {{r, static_cast<int>(i)}});
          bits_[k] |= bit;
        }
        if (is_compute(a.op)) weight_use(r, i, a);
      }
    }
    BRIGADE_CHECK(!(result_.has_backward && sh_.mode == Mode::Inference), Errc::InvalidArgument,
                  "validate: an inference schedule holds backward ops (B, BI or BW)");
    // Completeness: every micro-batch and chunk on every virtual stage.
    for (int v = 0; v < n_; ++v)
      for (int m = 0; m < m_; ++m)
        for (int c = 0; c < c_; ++c) {
          const std::uint32_t b = bits_[key(v, m, c)];
          auto missing = [&](std::string_view what) {
            ::brigade::detail::fail(
                Errc::InvalidArgument,
                "validate: micro-batch {}{} is missing on virtual stage {} (rank {}): {}", m,
                c ? fmt::format(" (chunk {})", c) : std::string(), v, sh_.rank_of(v), what);
          };
          if (!(b & kSeenF))
            missing(fmt::format("no forward {}", to_string(Action{Op::F, v, m, c})));
          if (result_.has_backward) {
            const bool full = b & kSeenB, in = b & kSeenBI, w = b & kSeenBW;
            if (!full && !in && !w)
              missing(fmt::format("no backward ({} or {} + {})", to_string(Action{Op::B, v, m, c}),
                                  to_string(Action{Op::BI, v, m, c}),
                                  to_string(Action{Op::BW, v, m, c})));
            if (full && (in || w))
              missing("both a full backward B and a split BI/BW; expected one or the other");
            if (!full && in != w)
              missing(in ? fmt::format("{} without {}", to_string(Action{Op::BI, v, m, c}),
                                       to_string(Action{Op::BW, v, m, c}))
                         : fmt::format("{} without {}", to_string(Action{Op::BW, v, m, c}),
                                       to_string(Action{Op::BI, v, m, c})));
          }
          if (sh_.mode == Mode::Inference && v == n_ - 1 && !(b & kSeenSample))
            missing(fmt::format("no {} (inference samples every round on the last stage)",
                                to_string(Action{Op::Sample, v, m, c})));
        }
    pair_migrations();
    // Every send has a receive (a receive without a send shows up as a deadlock instead).
    for (int r = 0; r < sh_.num_ranks; ++r) {
      const auto& prog = s_.ranks[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < prog.size(); ++i) {
        const Action& a = prog[i];
        if (a.op != Op::SendF && a.op != Op::SendB) continue;
        const Action peer = *counterpart(sh_, a);
        if (!(bits_[key(peer)] & seen_bit(peer.op)))
          fail_grid(
              Errc::InvalidArgument,
              fmt::format("validate: rank {} step {}: {} has no matching receive: {} is "
                          "absent from rank {}",
                          r, i, to_string(a), to_string(peer), sh_.rank_of(peer.virtual_stage)),
              {{r, static_cast<int>(i)}});
      }
    }
  }

  // ---- weights: PREFETCH / RELEASE residency, per virtual stage in its rank's program order ---
  /// Residency of virtual stage v's weights on its rank, as the program runs. A virtual stage
  /// whose first action in its rank's program (SEND/RECV aside) is a PREFETCH starts absent;
  /// every other one starts resident (a schedule without PREFETCH keeps all weights resident,
  /// as always).
  enum class Weights : std::uint8_t { Unseen, Resident, Absent };
  struct WeightState {
    Weights state = Weights::Unseen;
    std::int32_t step = -1;  // the step of the PREFETCH or RELEASE that set the state
  };

  // ---- migrations: MIGRATE on the layer's owner, MIGRATE_RECV on the neighbour adopting it --
  /// Where the program position of action `a` (by its seen bit) is: searched in rank r.
  [[nodiscard]] int step_of(int r, const Action& a) const {
    const auto& prog = s_.ranks[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < prog.size(); ++i)
      if (prog[i] == a) return static_cast<int>(i);
    return -1;
  }

  /// Pairs every MIGRATE(v, m, c) with the one MIGRATE_RECV(v +- 1, m, c) of a neighbouring
  /// virtual stage on another rank, and every MIGRATE_RECV with its MIGRATE.
  void pair_migrations() {
    for (int r = 0; r < sh_.num_ranks; ++r) {
      const auto& prog = s_.ranks[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < prog.size(); ++i) {
        const Action& a = prog[i];
        if (!is_migration(a.op)) continue;
        const bool send = a.op == Op::Migrate;
        const Op other = send ? Op::MigrateRecv : Op::Migrate;
        const std::uint32_t want = send ? kSeenMigrateRecv : kSeenMigrate;
        std::vector<int> found;
        for (int w : {a.virtual_stage - 1, a.virtual_stage + 1})
          if (w >= 0 && w < n_ && (bits_[key(w, a.microbatch, a.chunk)] & want)) found.push_back(w);
        const auto step = static_cast<int>(i);
        if (found.empty())
          fail_grid(Errc::InvalidArgument,
                    fmt::format("validate: rank {} step {}: {} has no pair: neither {} nor {} is "
                                "in any program ({} {} of a layer between neighbouring virtual "
                                "stages)",
                                r, i, to_string(a),
                                to_string(Action{other, a.virtual_stage - 1, a.microbatch, a.chunk}),
                                to_string(Action{other, a.virtual_stage + 1, a.microbatch, a.chunk}),
                                send ? "a MIGRATE sends a part to the MIGRATE_RECV" : "a MIGRATE_RECV receives the part of the MIGRATE",
                                send ? "of the neighbour adopting the layer" : "of the neighbour handing the layer over"),
                    {{r, step}});
        if (found.size() > 1)
          fail_grid(Errc::InvalidArgument,
                    fmt::format("validate: rank {} step {}: {} pairs with both {} and {}: a "
                                "virtual stage migrates one layer to one neighbour at a time",
                                r, i, to_string(a),
                                to_string(Action{other, found[0], a.microbatch, a.chunk}),
                                to_string(Action{other, found[1], a.microbatch, a.chunk})),
                    {{r, step}});
        const int w = found.front();
        if (sh_.rank_of(w) == r)
          fail_grid(Errc::InvalidArgument,
                    fmt::format("validate: rank {} step {}: {} pairs with {} on the same rank; a "
                                "layer moving within a rank needs no migration",
                                r, i, to_string(a),
                                to_string(Action{other, w, a.microbatch, a.chunk})),
                    {{r, step}});
        migrate_peer_[key(a)] = w;
        if (send) {
          send_m_[key(w, a.microbatch, a.chunk)] = {r, static_cast<std::int32_t>(i)};
          ++result_.migrations;
        }
      }
    }
  }

  /// The action `a` (a SEND/RECV or MIGRATE/MIGRATE_RECV) exchanges its message with.
  [[nodiscard]] Action peer_of(const Action& a) const {
    if (!is_migration(a.op)) return *counterpart(sh_, a);
    return {a.op == Op::Migrate ? Op::MigrateRecv : Op::Migrate, migrate_peer_[key(a)],
            a.microbatch, a.chunk};
  }

  /// Checks PREFETCH / RELEASE action `a` at rank r step i and records its effect.
  void weight_step(int r, std::size_t i, const Action& a) {
    const int v = a.virtual_stage;
    if (sh_.mode == Mode::Training)
      fail_grid(Errc::InvalidArgument,
                fmt::format("validate: rank {} step {}: {} in a training schedule: training "
                            "stages own their weights and the optimizer updates them in place, "
                            "so released weights could not be read back from their file; weight "
                            "offload runs in inference only",
                            r, i, to_string(a)),
                {{r, static_cast<int>(i)}});
    ++result_.weight_actions;
    auto& w = weights_[static_cast<std::size_t>(v)];
    const auto since = [&] {
      return w.step < 0 ? std::string("from the start")
                        : fmt::format("since step {} ({})", w.step,
                                      to_string(at(r, static_cast<std::size_t>(w.step))));
    };
    if (a.op == Op::Prefetch) {
      if (w.state == Weights::Resident)
        fail_grid(Errc::InvalidArgument,
                  fmt::format("validate: rank {} step {}: {} prefetches virtual stage {}, whose "
                              "weights are already resident ({}); RELEASE them before a new "
                              "PREFETCH",
                              r, i, to_string(a), v, since()),
                  w.step < 0 ? std::vector<Step>{{r, static_cast<int>(i)}}
                             : std::vector<Step>{{r, static_cast<int>(i)}, {r, w.step}});
      w = {Weights::Resident, static_cast<std::int32_t>(i)};
      return;
    }
    // RELEASE
    if (w.state == Weights::Absent)
      fail_grid(Errc::InvalidArgument,
                fmt::format("validate: rank {} step {}: {} releases virtual stage {}, whose "
                            "weights are not resident: released at step {} ({}) without a "
                            "PREFETCH since",
                            r, i, to_string(a), v, w.step,
                            to_string(at(r, static_cast<std::size_t>(w.step)))),
                {{r, static_cast<int>(i)}, {r, w.step}});
    w = {Weights::Absent, static_cast<std::int32_t>(i)};
  }

  /// Checks that compute action `a` (rank r, step i) finds its virtual stage's weights resident.
  void weight_use(int r, std::size_t i, const Action& a) {
    auto& w = weights_[static_cast<std::size_t>(a.virtual_stage)];
    if (w.state == Weights::Unseen) w.state = Weights::Resident;
    if (w.state == Weights::Absent)
      fail_grid(Errc::InvalidArgument,
                fmt::format("validate: rank {} step {}: {} runs on virtual stage {} after {} at "
                            "step {} without a {} in between: its weights are not resident",
                            r, i, to_string(a), a.virtual_stage,
                            to_string(at(r, static_cast<std::size_t>(w.step))), w.step,
                            to_string(Action{Op::Prefetch, a.virtual_stage, a.microbatch,
                                             a.chunk})),
                {{r, static_cast<int>(i)}, {r, w.step}});
  }

  // ---- dynamic pass: eager sends, blocking receives, dependency checks ----------------------
  [[noreturn]] void dependency_error(int r, std::size_t i, const std::string& why,
                                     std::vector<Step> extra = {}) const {
    std::vector<Step> marks{{r, static_cast<int>(i)}};
    marks.insert(marks.end(), extra.begin(), extra.end());
    fail_grid(Errc::InvalidArgument,
              fmt::format("validate: rank {} step {}: {} {}", r, i, to_string(at(r, i)), why),
              marks);
  }

  /// Fails with `why()` unless `ok`; the message is only formatted on failure.
  template <class Why>
  void need(bool ok, int r, std::size_t i, Why&& why) const {
    if (!ok) dependency_error(r, i, std::string(why()));
  }

  /// Checks the inputs of compute or send action `a` (rank r, step i) and records its effect.
  void execute_local(int r, std::size_t i, const Action& a) {
    const std::size_t k = key(a);
    std::uint32_t& b = bits_[k];
    switch (a.op) {
      case Op::F: {
        if (const auto up = upstream_input(sh_, a)) {
          if (sh_.rank_of(up->virtual_stage) == r) {
            const std::uint32_t want = up->op == Op::Sample ? kDoneSample : kDoneF;
            need(bits_[key(*up)] & want, r, i, [&] {
              return fmt::format("runs before its input {} on the same rank", to_string(*up));
            });
          } else {
            need(b & kDoneRecvF, r, i, [&] {
              return fmt::format(
                  "runs before its input arrived: no earlier {} on rank {}",
                  to_string(Action{Op::RecvF, a.virtual_stage, a.microbatch, a.chunk}), r);
            });
          }
        }
        if (sh_.mode == Mode::Inference && a.chunk > 0)
          need(bits_[key(a.virtual_stage, a.microbatch, a.chunk - 1)] & kDoneF, r, i, [&] {
            return fmt::format(
                "runs before round {} of the same micro-batch ({}): the KV cache is "
                "filled in round order",
                a.chunk - 1, to_string(Action{Op::F, a.virtual_stage, a.microbatch, a.chunk - 1}));
          });
        if (a.chunk > 0) {
          const std::uint32_t part = bits_[key(a.virtual_stage, a.microbatch, a.chunk - 1)];
          if ((part & kSeenMigrateRecv) && !(part & kDoneRecvM)) {
            const Action recv{Op::MigrateRecv, a.virtual_stage, a.microbatch, a.chunk - 1};
            const int j = step_of(r, recv);
            dependency_error(
                r, i,
                fmt::format("uses the layer its virtual stage adopts before the copy completes: "
                            "{} (step {}) receives round {}'s part of it later; the new owner "
                            "runs round c + 1 of a micro-batch only after the part of round c "
                            "(the last part completes the copy)",
                            to_string(recv), j, a.chunk - 1),
                {{r, j}});
          }
        }
        b |= kDoneF;
        return;
      }
      case Op::Migrate:
        need(b & kDoneF, r, i, [&] {
          return fmt::format("sends its part of round {} before {} wrote that round's KV rows",
                             a.chunk,
                             to_string(Action{Op::F, a.virtual_stage, a.microbatch, a.chunk}));
        });
        return;
      case Op::B:
      case Op::BI: {
        need(b & kDoneF, r, i, [&] {
          return fmt::format("is a backward before its forward {}",
                             to_string(Action{Op::F, a.virtual_stage, a.microbatch, a.chunk}));
        });
        if (const auto up = upstream_input(sh_, a)) {
          if (sh_.rank_of(up->virtual_stage) == r) {
            need(bits_[key(*up)] & kDoneBI, r, i, [&] {
              return fmt::format(
                  "runs before the backward of virtual stage {} (its output gradient) "
                  "on the same rank",
                  up->virtual_stage);
            });
          } else {
            need(b & kDoneRecvB, r, i, [&] {
              return fmt::format(
                  "runs before its output gradient arrived: no earlier {} on rank {}",
                  to_string(Action{Op::RecvB, a.virtual_stage, a.microbatch, a.chunk}), r);
            });
          }
        }
        b |= kDoneBI;
        if (a.op == Op::B) b |= kDoneW;
        return;
      }
      case Op::BW:
        need(b & kDoneBI, r, i, [&] {
          return fmt::format("runs before {}",
                             to_string(Action{Op::BI, a.virtual_stage, a.microbatch, a.chunk}));
        });
        b |= kDoneW;
        return;
      case Op::Recompute:
        need(b & kDoneF, r, i, [&] {
          return fmt::format("recomputes before the forward {} stashed its input",
                             to_string(Action{Op::F, a.virtual_stage, a.microbatch, a.chunk}));
        });
        return;
      case Op::Sample:
        need(b & kDoneF, r, i, [&] {
          return fmt::format("samples before the forward {}",
                             to_string(Action{Op::F, a.virtual_stage, a.microbatch, a.chunk}));
        });
        b |= kDoneSample;
        return;
      case Op::Opt: {
        need(result_.has_backward, r, i,
             [&] { return "is an optimizer step in a schedule without backward ops"; });
        for (int m = 0; m < m_; ++m)
          for (int c = 0; c < c_; ++c)
            need(bits_[key(a.virtual_stage, m, c)] & kDoneW, r, i, [&] {
              return fmt::format(
                  "steps the optimizer before the weight gradient of micro-batch {}{} "
                  "on virtual stage {}",
                  m, c ? fmt::format(" chunk {}", c) : std::string(), a.virtual_stage);
            });
        return;
      }
      case Op::SendF: {
        const bool token = sh_.mode == Mode::Inference && a.virtual_stage == n_ - 1;
        const std::uint32_t want = token ? kDoneSample : kDoneF;
        need(b & want, r, i, [&] {
          return fmt::format("sends before computing what it sends ({})",
                             to_string(Action{token ? Op::Sample : Op::F, a.virtual_stage,
                                              a.microbatch, a.chunk}));
        });
        return;
      }
      case Op::SendB:
        need(b & kDoneBI, r, i, [&] {
          return fmt::format("sends before the backward {} produced the gradient",
                             to_string(Action{Op::BI, a.virtual_stage, a.microbatch, a.chunk}));
        });
        return;
      case Op::RecvF:
      case Op::RecvB:
      case Op::Prefetch:
      case Op::Release:
      case Op::MigrateRecv:
        return;
    }
  }

  void dynamic_pass() {
    const int P = sh_.num_ranks;
    std::vector<std::size_t> pc(static_cast<std::size_t>(P), 0);
    std::vector<char> blocked(static_cast<std::size_t>(P), 0);
    std::vector<int> work;
    work.reserve(static_cast<std::size_t>(P));
    for (int r = P - 1; r >= 0; --r) work.push_back(r);
    while (!work.empty()) {
      const int r = work.back();
      work.pop_back();
      const auto& prog = s_.ranks[static_cast<std::size_t>(r)];
      std::size_t& i = pc[static_cast<std::size_t>(r)];
      blocked[static_cast<std::size_t>(r)] = 0;
      while (i < prog.size()) {
        const Action& a = prog[i];
        if (is_receive(a.op)) {
          std::uint32_t& b = bits_[key(a)];
          if (!(b & posted_bit(a.op))) {
            blocked[static_cast<std::size_t>(r)] = 1;
            break;
          }
          b |= done_bit(a.op);
          if (a.op != Op::MigrateRecv) ++result_.messages;
          ++i;
          continue;
        }
        execute_local(r, i, a);
        if (is_send(a.op)) {
          const Action peer = peer_of(a);
          bits_[key(peer)] |= posted_bit(peer.op);
          const int q = sh_.rank_of(peer.virtual_stage);
          const auto& qprog = s_.ranks[static_cast<std::size_t>(q)];
          const std::size_t qi = pc[static_cast<std::size_t>(q)];
          if (blocked[static_cast<std::size_t>(q)] && qi < qprog.size() && qprog[qi] == peer) {
            blocked[static_cast<std::size_t>(q)] = 0;
            work.push_back(q);
          }
        }
        ++i;
      }
    }
    std::vector<int> stuck;
    for (int r = 0; r < P; ++r)
      if (pc[static_cast<std::size_t>(r)] < s_.ranks[static_cast<std::size_t>(r)].size())
        stuck.push_back(r);
    if (!stuck.empty()) report_deadlock(pc, stuck);
  }

  // ---- matching: receives of a channel take its messages in the order they were sent -------
  /// The executor posts receives in program order and the transport hands a (peer, tag)'s
  /// messages to them in order, so the k-th receive of a channel must be the counterpart of the
  /// k-th send on it; otherwise the executor fails with HeaderMismatch (or waits forever).
  void order_pass() const {
    struct Entry {
      Action action;
      int rank;
      int index;
    };
    const auto P = static_cast<std::size_t>(sh_.num_ranks);
    auto chan = [&](int from, int to, int c) {
      return (static_cast<std::size_t>(from) * P + static_cast<std::size_t>(to)) * 4 +
             static_cast<std::size_t>(c);
    };
    std::vector<std::vector<Entry>> sends(P * P * 4), recvs(P * P * 4);
    for (int r = 0; r < sh_.num_ranks; ++r) {
      const auto& prog = s_.ranks[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < prog.size(); ++i) {
        const Action& a = prog[i];
        if (!is_communication(a.op) && !is_migration(a.op)) continue;
        const int peer = sh_.rank_of(peer_of(a).virtual_stage);
        const bool send = is_send(a.op);
        const int c = channel_of(sh_, a);
        (send ? sends[chan(r, peer, c)] : recvs[chan(peer, r, c)])
            .push_back({a, r, static_cast<int>(i)});
      }
    }
    static constexpr std::array<std::string_view, 4> names = {"activation", "gradient", "token",
                                                              "migration"};
    for (std::size_t ch = 0; ch < sends.size(); ++ch) {
      const auto& snd = sends[ch];
      const auto& rcv = recvs[ch];
      for (std::size_t k = 0; k < std::min(snd.size(), rcv.size()); ++k) {
        if (peer_of(snd[k].action) == rcv[k].action) continue;
        fail_grid(Errc::InvalidArgument,
                  fmt::format("validate: rank {} step {}: {} is receive #{} from rank {} on the "
                              "{} channel, but message #{} that rank {} sends on it is {} (step "
                              "{}); receives match sends in order per (peer, tag), so the "
                              "executor would fail with HeaderMismatch: send them in the order "
                              "they are received",
                              rcv[k].rank, rcv[k].index, to_string(rcv[k].action), k + 1,
                              snd[k].rank, names[ch % 4], k + 1, snd[k].rank,
                              to_string(snd[k].action), snd[k].index),
                  {{rcv[k].rank, rcv[k].index}, {snd[k].rank, snd[k].index}});
      }
    }
  }

  // ---- rendezvous: a send completes only when its receive is posted ------------------------
  /// The executor with bounded windows over a transport whose sends complete only when the
  /// matching receive has been posted: a rank posts its RECVs in program order at most
  /// recv_window ahead of the next one it waits on; a SEND with send_window sends in flight
  /// first waits for the oldest; the program ends by waiting for all its sends.
  void rendezvous_pass() {
    const int P = sh_.num_ranks;
    const auto W = static_cast<std::size_t>(model_.windows.recv_window);
    const auto SW = static_cast<std::size_t>(model_.windows.send_window);
    // Rank-local index of every RECV among its rank's receives, by the receiver's key.
    std::vector<std::int32_t> recv_index_f(bits_.size(), -1), recv_index_b(bits_.size(), -1),
        recv_index_m(bits_.size(), -1);
    auto index_of = [&](Op op) -> std::vector<std::int32_t>& {
      return op == Op::RecvF ? recv_index_f : op == Op::RecvB ? recv_index_b : recv_index_m;
    };
    for (int r = 0; r < P; ++r) {
      std::int32_t k = 0;
      for (const auto& a : s_.ranks[static_cast<std::size_t>(r)])
        if (is_receive(a.op)) index_of(a.op)[key(a)] = k++;
    }
    struct InFlight {
      int to;
      std::int32_t recv;  // receiver-local receive index
      std::size_t step;
    };
    std::vector<std::size_t> pc(static_cast<std::size_t>(P), 0), rdone(static_cast<std::size_t>(P), 0);
    std::vector<std::vector<InFlight>> flight(static_cast<std::size_t>(P));
    std::vector<std::size_t> head(static_cast<std::size_t>(P), 0);
    auto posted = [&](const InFlight& f) {
      return static_cast<std::size_t>(f.recv) < rdone[static_cast<std::size_t>(f.to)] + W;
    };
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < P; ++r) {
        const auto ur = static_cast<std::size_t>(r);
        const auto& prog = s_.ranks[ur];
        auto& fl = flight[ur];
        for (;;) {
          const std::size_t in_flight = fl.size() - head[ur];
          if (pc[ur] == prog.size()) {
            if (in_flight > 0 && posted(fl[head[ur]])) {
              ++head[ur];
              progress = true;
              continue;
            }
            break;
          }
          const Action& a = prog[pc[ur]];
          if (is_receive(a.op)) {
            std::uint32_t& b = bits_[key(a)];
            if (!(b & posted_bit(a.op))) break;
            b |= done_bit(a.op);
            if (a.op != Op::MigrateRecv) ++result_.messages;
            ++rdone[ur];
          } else if (is_send(a.op)) {
            if (in_flight == SW) {
              if (!posted(fl[head[ur]])) break;
              ++head[ur];
            }
            execute_local(r, pc[ur], a);
            const Action peer = peer_of(a);
            bits_[key(peer)] |= posted_bit(peer.op);
            const auto idx = index_of(peer.op)[key(peer)];
            fl.push_back({sh_.rank_of(peer.virtual_stage), idx, pc[ur]});
          } else {
            execute_local(r, pc[ur], a);
          }
          ++pc[ur];
          progress = true;
        }
      }
    }
    std::vector<int> stuck;
    for (int r = 0; r < P; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      if (pc[ur] < s_.ranks[ur].size() || head[ur] < flight[ur].size()) stuck.push_back(r);
    }
    if (stuck.empty()) return;
    std::string msg = fmt::format("validate ({}): deadlock:\n", describe(model_));
    std::vector<Step> marks;
    for (int r : stuck) {
      const auto ur = static_cast<std::size_t>(r);
      const auto& prog = s_.ranks[ur];
      const bool at_end = pc[ur] == prog.size();
      const Action* a = at_end ? nullptr : &prog[pc[ur]];
      if (a && is_receive(a->op)) {
        msg += fmt::format("  rank {} blocks at step {} on {} (not yet sent)\n", r, pc[ur],
                           to_string(*a));
      } else {
        const auto& f = flight[ur][head[ur]];
        msg += fmt::format(
            "  rank {} blocks at step {} ({}) waiting for its send {} (step {}) to complete: rank "
            "{} has not posted that receive (its receive #{}, {} received so far, window {})\n",
            r, pc[ur], at_end ? std::string("end of program") : to_string(*a),
            to_string(prog[f.step]), f.step, f.to, f.recv + 1, rdone[static_cast<std::size_t>(f.to)],
            W);
      }
      marks.push_back({r, static_cast<int>(std::min(pc[ur], prog.empty() ? 0 : prog.size() - 1))});
    }
    fail_grid(Errc::Deadlock, msg, marks);
  }

  /// Every stuck rank waits on a RECV; its sender is blocked earlier in its own program, or the
  /// send does not exist. Follows the wait-for edges and reports a cycle, else a chain that ends
  /// at the missing send.
  [[noreturn]] void report_deadlock(const std::vector<std::size_t>& pc,
                                    const std::vector<int>& stuck) const {
    const int P = sh_.num_ranks;
    auto recv_of = [&](int r) -> const Action& { return at(r, pc[static_cast<std::size_t>(r)]); };
    auto sender_of = [&](int r) -> Where {
      if (pc[static_cast<std::size_t>(r)] >= s_.ranks[static_cast<std::size_t>(r)].size())
        return Where{};  // cannot happen: a sender that finished has posted its sends
      const Action& a = recv_of(r);
      return (a.op == Op::RecvF ? send_f_ : a.op == Op::RecvB ? send_b_ : send_m_)[key(a)];
    };
    // Functional graph r -> sender rank; find a cycle by walking from each stuck rank.
    std::vector<int> color(static_cast<std::size_t>(P), 0);  // 0 new, 1 on path, 2 done
    std::vector<int> cycle;
    for (int start : stuck) {
      if (color[static_cast<std::size_t>(start)] != 0) continue;
      std::vector<int> path;
      int r = start;
      while (r >= 0 && color[static_cast<std::size_t>(r)] == 0) {
        color[static_cast<std::size_t>(r)] = 1;
        path.push_back(r);
        r = sender_of(r).rank;
      }
      if (r >= 0 && color[static_cast<std::size_t>(r)] == 1) {
        auto it = std::find(path.begin(), path.end(), r);
        cycle.assign(it, path.end());
      }
      for (int p : path) color[static_cast<std::size_t>(p)] = 2;
      if (!cycle.empty()) break;
    }
    auto step = [&](int r) { return static_cast<int>(pc[static_cast<std::size_t>(r)]); };
    auto describe = [&](int r) {
      const Action& a = recv_of(r);
      const Where w = sender_of(r);
      const Action peer = peer_of(a);
      if (w.rank < 0)
        return fmt::format(
            "  rank {} blocks at step {} on {}, but no rank sends it ({} is absent "
            "from rank {})\n",
            r, step(r), to_string(a), to_string(peer), sh_.rank_of(peer.virtual_stage));
      return fmt::format("  rank {} blocks at step {} on {}, sent by {} at rank {} step {}\n", r,
                         step(r), to_string(a), to_string(peer), w.rank, w.index);
    };
    std::vector<Step> marks;
    std::string msg;
    if (!cycle.empty()) {
      msg = "validate: deadlock: wait-for cycle ";
      for (int r : cycle) msg += fmt::format("rank {} -> ", r);
      msg += fmt::format("rank {}\n", cycle.front());
      for (int r : cycle) {
        msg += describe(r);
        marks.push_back({r, step(r)});
      }
      msg += "cycle: ";
      for (int r : cycle) msg += fmt::format("rank {} waits {} <- ", r, to_string(recv_of(r)));
      msg += fmt::format("rank {}", cycle.front());
    } else {
      // No cycle: follow the chain from the first stuck rank to the missing send.
      std::vector<int> chain;
      for (int r = stuck.front(); r >= 0; r = sender_of(r).rank) {
        chain.push_back(r);
        if (chain.size() > static_cast<std::size_t>(P)) break;
      }
      const int end = chain.back();
      const Action peer = peer_of(recv_of(end));
      msg = fmt::format(
          "validate: deadlock: rank {} waits on {}, which no rank sends (receive "
          "without send)\n",
          end, to_string(recv_of(end)));
      for (int r : chain) {
        msg += describe(r);
        marks.push_back({r, step(r)});
      }
      msg += "wait-for chain: ";
      for (int r : chain) msg += fmt::format("rank {} waits {} <- ", r, to_string(recv_of(r)));
      msg += fmt::format("missing {} on rank {}", to_string(peer), sh_.rank_of(peer.virtual_stage));
    }
    if (stuck.size() > marks.size())
      msg += fmt::format("\n{} of {} ranks are blocked in all", stuck.size(), P);
    fail_grid(Errc::Deadlock, msg, marks);
  }

  const Schedule& s_;
  const Shape& sh_;
  ExecutionModel model_;
  int n_ = 0, m_ = 0, c_ = 0;
  std::vector<std::uint32_t> bits_;
  std::vector<Where> send_f_, send_b_, send_m_;  // indexed by the receiver's key
  std::vector<std::int32_t> migrate_peer_;  // per MIGRATE / MIGRATE_RECV key: the paired stage
  std::vector<WeightState> weights_;    // per virtual stage
  ValidationResult result_;
};

}  // namespace detail

/// Executes a lowered schedule symbolically and proves that every rank's program completes.
///
/// Semantics: those of engine::execute, so "validates" means "the executor completes". A RECV
/// blocks until its matching SEND (see counterpart()) has been issued; a compute action never
/// blocks, so its inputs must already be present on its rank when it is reached; the receives
/// of a channel (sender rank, receiver rank, channel_of()) take its messages in the order they
/// were sent. Sends, by `model.sends`: Eager (buffered, they never block) or Rendezvous (a send
/// completes only once its receive is posted; the executor's windows `model.windows` then
/// decide when a rank waits: it posts RECVs at most recv_window ahead, waits for its oldest
/// send before exceeding send_window sends in flight, and for all of them at the end).
///
/// Checks, in order:
/// 1. the shape, every action's range, and that each action runs on its virtual stage's rank;
/// 2. pairing: each SEND/RECV has a counterpart on another rank; no action appears twice;
///    every SEND has its RECV somewhere;
/// 3. completeness: every (virtual stage, micro-batch, chunk) has its F; if any backward op is
///    present, exactly one B or one BI + BW each; inference samples every round;
/// 4. the symbolic run: dependencies (a backward before its forward, a forward before its input
///    arrived, BW before BI, OPT before the weight gradients) and termination;
/// 5. matching: the k-th receive of every channel is the counterpart of the k-th send on it
///    (else the executor would fail with HeaderMismatch);
/// 6. weights (checked with 1, in each rank's program order): a virtual stage's weights are
///    resident from the start unless its rank's first action on it is a PREFETCH; PREFETCH of
///    resident weights, RELEASE of weights not resident (RELEASE twice), and a compute action
///    of a virtual stage after its RELEASE without a PREFETCH in between are refused;
///    PREFETCH/RELEASE in a training schedule are refused (training stages own and update their
///    weights);
/// 7. migrations (DynaPipe's layer moves, one message pair per part): every MIGRATE(v, m, c)
///    pairs with exactly one MIGRATE_RECV(v +- 1, m, c) on the neighbour's rank and every
///    MIGRATE_RECV with its MIGRATE (a half without its pair is refused naming its step); the
///    sender's MIGRATE(v, m, c) comes after F(v, m, c) (the part carries the KV rows that round
///    wrote); the receiver's F(w, m, c + 1) comes after MIGRATE_RECV(w, m, c) (a layer is not
///    used by its new owner before the copy completes: the last part completes it); a
///    MIGRATE_RECV blocks until its MIGRATE is issued, like a RECV, on a channel of its own;
///    migrations in a training schedule are refused.
///
/// Runs in O(actions + stages x micro-batches x chunks) time with eager sends; the rendezvous
/// run is a fixed point over the ranks, O(ranks x actions) in the worst case.
///
/// @param lowered a schedule with explicit communication (lower()'s output, or hand-written)
/// @param model   the send semantics and windows to check against (default: eager)
/// @return counts of what was proved, and `semantics`, the line describing `model`
/// @throws brigade::Error{Errc::Deadlock} when the programs cannot all finish; the message names
///         the wait-for cycle ("rank 1 waits 1RECV_F3 <- rank 0 waits 0RECV_B2 <- rank 1"), or
///         the chain ending at a receive whose send is missing, followed by the render_grid()
///         excerpt around the blocked steps; under Rendezvous, each blocked rank and the send or
///         receive it waits for
/// @throws brigade::Error{Errc::InvalidArgument} for a failed check of 1-3, 5 or 6, a window < 1,
///         or a dependency
///         violation, naming the rank, the step and the action, with a grid excerpt
inline ValidationResult validate(const Schedule& lowered, const ExecutionModel& model = {}) {
  detail::Validator v(lowered, model);
  return v.run();
}

}  // namespace v0
}  // namespace brigade::schedule
