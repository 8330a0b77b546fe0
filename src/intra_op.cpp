// The intra-op team of each kernel-running thread (intra_op.hpp).
#include "intra_op.hpp"

#include "brigade/backend/cpu.hpp"
#include "brigade/core/error.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace brigade::cpu {
namespace {

std::atomic<int>& thread_count() {
  static std::atomic<int> n{1};
  return n;
}

void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

/// How long an idle worker spins before it sleeps on a futex: long enough to span the serial
/// work between two products of a decode step (norms, attention, sampling: tens of
/// microseconds), short enough not to take a core from another stage for long.
constexpr auto kSpin = std::chrono::microseconds(300);

/// workers_.size() + 1 threads, the caller being part 0.
class Team {
 public:
  explicit Team(int threads) {
    workers_.reserve(static_cast<std::size_t>(threads - 1));
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;
  ~Team() {
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    generation_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int size() const noexcept { return static_cast<int>(workers_.size()) + 1; }

  void run(int parts, void (*fn)(void*, int), void* ctx) {
    fn_ = fn;
    ctx_ = ctx;
    parts_ = parts;
    error_ = nullptr;
    pending_.store(size() - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) generation_.notify_all();
    std::exception_ptr mine;
    inside_part() = true;  // a kernel called from part 0 runs inline too: teams never nest
    try {
      fn(ctx, 0);
    } catch (...) {
      mine = std::current_exception();
    }
    inside_part() = false;
    for (std::uint32_t spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
      if (spins < 20000) {
        cpu_relax();
      } else {
        std::this_thread::yield();  // a worker was descheduled (more threads than cores)
      }
    }
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work(int index) {
    inside_part() = true;  // a kernel called from a part runs inline
    std::uint32_t seen = 0;
    for (;;) {
      std::uint32_t g = generation_.load(std::memory_order_acquire);
      auto since = std::chrono::steady_clock::now();
      for (std::uint32_t spins = 1; g == seen; ++spins) {
        cpu_relax();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - since > kSpin) {
          // Registered as a sleeper before the last check: the caller either sees the count
          // and wakes us, or we see its new generation (both are sequentially consistent).
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (generation_.load(std::memory_order_seq_cst) == seen)
            generation_.wait(seen, std::memory_order_seq_cst);
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          since = std::chrono::steady_clock::now();
        }
        g = generation_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_.load(std::memory_order_relaxed)) return;
      if (index < parts_) {
        try {
          fn_(ctx_, index);
        } catch (...) {
          std::lock_guard lock(error_mutex_);
          if (!error_) error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

 public:
  static bool& inside_part() {
    thread_local bool inside = false;
    return inside;
  }

 private:
  std::vector<std::thread> workers_;
  alignas(64) std::atomic<std::uint32_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  void (*fn_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
  int parts_ = 0;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

/// The calling thread's team, (re)built at the current thread count.
Team& team(int threads) {
  thread_local std::unique_ptr<Team> t;
  if (!t || t->size() != threads) {
    t.reset();
    t = std::make_unique<Team>(threads);
  }
  return *t;
}

}  // namespace

inline namespace v0 {
void set_blas_threads(int n) {
  BRIGADE_CHECK(n >= 1, Errc::InvalidArgument, "set_blas_threads: n = {}; expected >= 1", n);
  thread_count().store(n, std::memory_order_relaxed);
}

int blas_threads() { return thread_count().load(std::memory_order_relaxed); }

}  // namespace v0
}  // namespace brigade::cpu

namespace brigade::cpu::detail {

int intra_op_threads(double flops) noexcept {
  const int n = thread_count().load(std::memory_order_relaxed);
  return n > 1 && flops >= kParallelMinFlops && !Team::inside_part() ? n : 1;
}

void run_parts(int parts, void (*fn)(void*, int), void* ctx) {
  if (parts <= 1 || Team::inside_part()) {
    for (int p = 0; p < parts; ++p) fn(ctx, p);
    return;
  }
  const int n = thread_count().load(std::memory_order_relaxed);
  BRIGADE_CHECK(parts <= n, Errc::InvalidArgument,
                "run_parts: {} parts with {} intra-op threads; expected parts <= threads", parts,
                n);
  team(n).run(parts, fn, ctx);
}

}  // namespace brigade::cpu::detail
