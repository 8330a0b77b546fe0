// The memory model per rank (cost/memory.hpp) against the heap bytes each rank really holds
// (docs/benchmarks.md, "Memory per rank").
//
// Measurement: this binary replaces the global operator new and delete. Every allocation carries
// a header with its size and the slot of the thread that made it (slot 0: the main thread; slot
// r + 1: the thread of pipeline rank r, set by the rank's own thread before it builds anything);
// a delete, from whatever thread, subtracts the bytes from the slot that allocated them. A
// rank's measured peak is the most live bytes of its slot at any moment of the run: everything
// the rank allocated and has not freed (its stages, KV cache, optimizer, stashes, buffers, the
// messages it sent and its peer has not yet taken). The binary also interposes calloc, free and
// realloc (forwarding to glibc's __libc_* entry points): a calloc'd block (backend::CpuBackend's
// buffers: the KV pools, the training stages' device-side tensors) is charged to its thread's slot
// through a fixed table of live calloc'd blocks. Memory malloc'd outside operator new (by
// OpenBLAS) and the thread stacks are not counted, nor is the allocator's own overhead.
//
//   BM_InferenceMemory  the "42M" synthetic Llama (dim 512, 8 layers, vocab 32000) on 2 ranks,
//       32 sequences of an 8-token prompt generating to 512 positions (KV cache reserved for
//       512 positions per sequence), greedy, 2 micro-batches: per rank the predicted bytes
//       (engine::inference_memory, weights excluded: the ranks share the caller's weights in
//       one process) against the rank thread's measured peak; and the model's weights
//       predicted (cost::model_weight_bytes) against the bytes make_synthetic_weights
//       allocated.
//   BM_TrainingMemory  the same model trained on 2 ranks (1F1B, M = 8 micro-batches of one
//       256-token sequence), each rank a DistributedTrainer built in its own thread (its
//       stages copy their weights): per rank cost::training_memory against the measured peak
//       over construction and one train_step.
#include <brigade/cost/memory.hpp>
#include <brigade/engine/inference.hpp>
#include <brigade/engine/threads.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/engine/training_distributed.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/transport/in_process.hpp>

#include <benchmark/benchmark.h>

#include "machine_context.hpp"
#include "workloads.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>

namespace {

constexpr int kSlots = 9;  // main thread + up to 8 ranks
std::atomic<std::int64_t> g_live[kSlots];
std::atomic<std::int64_t> g_peak[kSlots];
thread_local int t_slot = 0;

/// Precedes every block: its size, the pointer malloc returned and the allocating slot.
struct alignas(16) Header {
  std::size_t size;
  void* raw;
  int slot;
};
static_assert(sizeof(Header) == 32);

void account(int slot, std::int64_t delta) noexcept {
  const std::int64_t now = g_live[slot].fetch_add(delta, std::memory_order_relaxed) + delta;
  std::int64_t peak = g_peak[slot].load(std::memory_order_relaxed);
  while (now > peak && !g_peak[slot].compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void* counted(std::size_t n, std::size_t align) noexcept {
  const std::size_t off = std::max<std::size_t>(sizeof(Header), align);
  void* raw = align <= alignof(std::max_align_t)
                  ? std::malloc(n + off)
                  : std::aligned_alloc(align, (n + off + align - 1) / align * align);
  if (raw == nullptr) return nullptr;
  auto* p = static_cast<char*>(raw) + off;
  auto* h = reinterpret_cast<Header*>(p - sizeof(Header));
  h->size = n;
  h->raw = raw;
  h->slot = t_slot;
  account(t_slot, static_cast<std::int64_t>(n));
  return p;
}

void release(void* p) noexcept {
  if (p == nullptr) return;
  auto* h = reinterpret_cast<Header*>(static_cast<char*>(p) - sizeof(Header));
  account(h->slot, -static_cast<std::int64_t>(h->size));
  std::free(h->raw);
}

void* counted_or_throw(std::size_t n, std::size_t align) {
  void* p = counted(n, align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

// calloc'd blocks: (pointer, bytes, slot) in an open-addressed table under a spin lock (nothing
// here may allocate: free and calloc run inside the allocator's callers, before main, in any
// thread). Erased entries become tombstones; the table is sized far above the few hundred
// buffers a run holds.
constexpr std::size_t kCallocTable = std::size_t{1} << 14;
void* const kTombstone = reinterpret_cast<void*>(std::uintptr_t{1});
struct CallocEntry {
  void* ptr;
  std::size_t size;
  int slot;
};
CallocEntry g_calloc[kCallocTable];
std::atomic<std::int64_t> g_calloc_live{0};  // entries in the table
std::atomic<std::int64_t> g_calloc_lost{0};  // blocks that found the table full (reported)
std::atomic_flag g_calloc_lock = ATOMIC_FLAG_INIT;

struct CallocLock {
  CallocLock() noexcept {
    while (g_calloc_lock.test_and_set(std::memory_order_acquire)) {
    }
  }
  ~CallocLock() { g_calloc_lock.clear(std::memory_order_release); }
};

std::size_t calloc_hash(const void* p) noexcept {
  return (reinterpret_cast<std::uintptr_t>(p) >> 4) * 0x9E3779B97F4A7C15ULL >> 50;
}

void calloc_record(void* p, std::size_t n, int slot) noexcept {
  CallocLock lock;
  for (std::size_t i = calloc_hash(p), k = 0; k < kCallocTable; ++k, i = (i + 1) % kCallocTable) {
    auto& e = g_calloc[i];
    if (e.ptr == nullptr || e.ptr == kTombstone) {
      e = {p, n, slot};
      g_calloc_live.fetch_add(1, std::memory_order_relaxed);
      account(slot, static_cast<std::int64_t>(n));
      return;
    }
  }
  g_calloc_lost.fetch_add(1, std::memory_order_relaxed);
}

/// Removes `p` from the table if it is there; returns its entry (ptr null when it was not).
CallocEntry calloc_forget(void* p) noexcept {
  if (g_calloc_live.load(std::memory_order_relaxed) == 0) return {};
  CallocLock lock;
  for (std::size_t i = calloc_hash(p), k = 0; k < kCallocTable; ++k, i = (i + 1) % kCallocTable) {
    auto& e = g_calloc[i];
    if (e.ptr == nullptr) return {};
    if (e.ptr == p) {
      const CallocEntry out = e;
      e.ptr = kTombstone;
      g_calloc_live.fetch_sub(1, std::memory_order_relaxed);
      account(out.slot, -static_cast<std::int64_t>(out.size));
      return out;
    }
  }
  return {};
}

/// Starts a measurement: every slot's peak becomes its live bytes now.
void reset_peaks() {
  for (int s = 0; s < kSlots; ++s) g_peak[s].store(g_live[s].load());
}

}  // namespace

void* operator new(std::size_t n) { return counted_or_throw(n, 1); }
void* operator new[](std::size_t n) { return counted_or_throw(n, 1); }
void* operator new(std::size_t n, std::align_val_t a) {
  return counted_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return counted_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted(n, 1); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted(n, 1); }
void operator delete(void* p) noexcept { release(p); }
void operator delete[](void* p) noexcept { release(p); }
void operator delete(void* p, std::size_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t) noexcept { release(p); }
void operator delete(void* p, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { release(p); }

extern "C" {
void* __libc_calloc(std::size_t, std::size_t);
void __libc_free(void*);
void* __libc_realloc(void*, std::size_t);

void* calloc(std::size_t count, std::size_t size) {
  void* p = __libc_calloc(count, size);
  if (p != nullptr) calloc_record(p, count * size, t_slot);
  return p;
}
void free(void* p) {
  if (p != nullptr) calloc_forget(p);
  __libc_free(p);
}
void* realloc(void* p, std::size_t n) {
  const CallocEntry e = p != nullptr ? calloc_forget(p) : CallocEntry{};
  void* q = __libc_realloc(p, n);
  if (e.ptr != nullptr && q != nullptr) calloc_record(q, n, e.slot);
  if (e.ptr != nullptr && q == nullptr && n != 0) calloc_record(p, e.size, e.slot);  // p kept
  return q;
}
}

using namespace brigade;

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

/// The 42M weights and the heap bytes their construction left allocated.
const model::LlamaWeights& weights42m(double* allocated = nullptr) {
  static double bytes = 0.0;
  static const auto w = [] {
    const std::int64_t before = g_live[0].load();
    auto x = model::make_synthetic_weights(model::named_config("42M"), 1234);
    bytes = static_cast<double>(g_live[0].load() - before);
    return x;
  }();
  if (allocated != nullptr) *allocated = bytes;
  return w;
}

void report(benchmark::State& state, std::span<const cost::MemoryBreakdown> predicted,
            std::span<const double> measured, bool with_weights) {
  double worst = 0.0;
  for (std::size_t r = 0; r < predicted.size(); ++r) {
    const double p = predicted[r].total() - (with_weights ? 0.0 : predicted[r].weights);
    const double m = measured[r];
    const std::string k = "rank" + std::to_string(r);
    state.counters[k + "_predicted_mib"] = p / kMiB;
    state.counters[k + "_measured_mib"] = m / kMiB;
    state.counters[k + "_ratio"] = p / m;
    worst = std::max(worst, std::abs(p / m - 1.0));
  }
  state.counters["worst_error"] = worst;
  // Calloc'd blocks the table had no room for (uncounted): 0 in a valid run.
  state.counters["calloc_uncounted"] = static_cast<double>(g_calloc_lost.load());
}

void BM_InferenceMemory(benchmark::State& state) {
  double weights_allocated = 0.0;
  const auto& w = weights42m(&weights_allocated);
  const model::ModelSpec spec(w.config);
  const int P = 2, sequences = 32, steps = 512;
  std::vector<engine::GenerationRequest> reqs;
  for (int i = 0; i < sequences; ++i) {
    std::vector<int> prompt{1};
    for (int t = 1; t < 8; ++t) prompt.push_back(100 + 37 * i + t);
    reqs.push_back({prompt, steps});
  }
  engine::InferenceOptions opt;
  opt.microbatches = 2;
  const auto part = partition::make_partition(spec, "balanced", [&] {
    partition::PolicyRequest r;
    r.placement = {0, 1};
    r.num_ranks = P;
    r.work = {sequences / 2, sequences / 2, steps / 2.0};
    return r;
  }());
  const auto plan = engine::inference_plan(w.config, part, reqs, opt.microbatches);
  const auto predicted = engine::inference_memory(w.config, plan, reqs);
  std::vector<double> measured(P);
  std::int64_t generated = 0;
  for (auto _ : state) {
    const auto layout = engine::check_inference_plan(plan, w.config, reqs, opt, "bench");
    engine::detail::SequenceBook book(reqs, w.config.seq_len, plan.shape().num_microbatches);
    transport::InProcessFabric fabric(P);
    std::vector<Timeline> timelines(P, Timeline(P));
    const auto t0 = std::chrono::steady_clock::now();
    reset_peaks();
    std::vector<std::int64_t> start(P);
    auto endpoints = transport::endpoints(fabric);
    engine::run_ranks(std::span(endpoints), [&](transport::InProcessTransport& tp) {
      const int r = tp.rank();
      t_slot = r + 1;
      start[static_cast<std::size_t>(r)] = g_live[r + 1].load();
      engine::run_inference_rank(tp, w, plan, layout, r == plan.shape().rank_of(0) ? &book : nullptr,
                                 opt, t0, timelines[static_cast<std::size_t>(r)]);
    });
    for (int r = 0; r < P; ++r)
      measured[static_cast<std::size_t>(r)] =
          static_cast<double>(g_peak[r + 1].load() - start[static_cast<std::size_t>(r)]);
    for (const auto& s : book.results()) generated += s.generated;
  }
  report(state, predicted, measured, false);
  for (int r = 0; r < P; ++r) {
    const auto& b = predicted[static_cast<std::size_t>(r)];
    state.counters["rank" + std::to_string(r) + "_kv_mib"] = b.kv_cache / kMiB;
  }
  state.counters["weights_predicted_mib"] = cost::model_weight_bytes(spec) / kMiB;
  state.counters["weights_measured_mib"] = weights_allocated / kMiB;
  state.counters["generated_tokens"] = static_cast<double>(generated);
}
BENCHMARK(BM_InferenceMemory)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(1);

/// M micro-batches, each one sequence of 257 random tokens (256 target rows).
std::vector<data::PackedBatch> batches(int m) { return bench::random_sequences(m, 256, 32000, 7); }

void BM_TrainingMemory(benchmark::State& state) {
  const auto& w = weights42m();
  const model::ModelSpec spec(w.config);
  const int P = 2, M = 8;
  engine::TrainingConfig cfg;
  cfg.schedule = "1f1b";
  cfg.ranks = P;
  cfg.microbatches = M;
  const auto data = batches(M);
  const auto base = engine::training_plan(w.config, cfg);
  const plan::Plan plan(base.partition(), base.schedule(), engine::microbatch_work(data),
                        base.execution());
  const auto predicted = cost::training_memory(spec, plan);
  std::vector<double> measured(P), executor(P);
  double loss = 0.0;
  for (auto _ : state) {
    transport::InProcessFabric fabric(P);
    reset_peaks();
    std::vector<std::int64_t> start(P);
    auto endpoints = transport::endpoints(fabric);
    engine::run_ranks(std::span(endpoints), [&](transport::InProcessTransport& tp) {
      const int r = tp.rank();
      t_slot = r + 1;
      start[static_cast<std::size_t>(r)] = g_live[r + 1].load();
      engine::DistributedTrainer<transport::InProcessTransport> trainer(tp, w, plan, cfg);
      const auto res = trainer.train_step(data);
      if (r == 0) {
        loss = res.loss;
        executor = res.peak_memory_bytes;
      }
    });
    for (int r = 0; r < P; ++r)
      measured[static_cast<std::size_t>(r)] =
          static_cast<double>(g_peak[r + 1].load() - start[static_cast<std::size_t>(r)]);
  }
  if (!std::isfinite(loss) || loss < 5.0) state.SkipWithError("implausible loss");
  report(state, predicted, measured, true);
  for (int r = 0; r < P; ++r) {
    const auto& b = predicted[static_cast<std::size_t>(r)];
    const std::string k = "rank" + std::to_string(r);
    state.counters[k + "_activations_predicted_mib"] = b.activations / kMiB;
    state.counters[k + "_activations_executor_mib"] = executor[static_cast<std::size_t>(r)] / kMiB;
  }
}
BENCHMARK(BM_TrainingMemory)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(1);

}  // namespace

int main(int argc, char** argv) { return brigade::bench::run_benchmarks(argc, argv); }
