// What a live layer move costs the stage that adopts the layer (serve's dynamic rebalancer,
// docs/serving.md "Where a migration's time goes"): begin_adopt, the layer's weight image and
// KV rows written in 1 MiB parts as MIGRATE_RECV writes them, then adopt(), on the "42M"
// synthetic Llama (one decoder: 12.6 MB of f32 weights; its KV cache for 8192 pool rows,
// 32 MiB, all of them written).
//
//   BM_AdoptLayer/fresh     into memory allocated for the adoption, first touched by the parts
//                           (the stage has no spare: a new stage every iteration, untimed)
//   BM_AdoptLayer/recycled  into the KV cache and image the stage's drop() of the same layer
//                           left (InferenceStage's spares)
//
// Counters: bytes_per_second over the image and the rows; seconds_per_MiB. The ratio of the two
// rows is what recycling saves a move.
//
//   build/bench/bench_adopt --benchmark_min_time=1
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/runtime/inference_stage.hpp>

#include <benchmark/benchmark.h>

#include "machine_context.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

namespace {

using namespace brigade;

constexpr std::size_t kPart = std::size_t{1} << 20;
const std::vector<int> kCaps(16, 512);  // 16 sequences x 512 positions: 8192 pool rows

const model::LlamaWeights& weights() {
  static const auto w = model::make_synthetic_weights(model::named_config("42M"), 1234);
  return w;
}

// begin_adopt(layer), the image and every pool row in parts of kPart, adopt(): the bytes.
std::size_t adopt(runtime::InferenceStage<>& st, int layer, const std::vector<std::byte>& image,
                  const std::vector<std::byte>& rows) {
  st.begin_adopt(layer);
  const auto dst = st.adopt_weight_image();
  for (std::size_t o = 0; o < image.size(); o += kPart)
    std::memcpy(dst.data() + o, image.data() + o, std::min(kPart, image.size() - o));
  const std::size_t row_bytes = st.kv_position_bytes();
  const auto per_part = static_cast<std::int64_t>(kPart / row_bytes);
  const auto n = static_cast<std::int64_t>(rows.size() / row_bytes);
  for (std::int64_t r = 0; r < n; r += per_part) {
    const std::int64_t k = std::min(per_part, n - r);
    st.write_kv_rows(layer, r, k, rows.data() + static_cast<std::size_t>(r) * row_bytes);
  }
  st.adopt();
  return image.size() + rows.size();
}

void BM_AdoptLayer(benchmark::State& state, bool recycled) {
  const auto& w = weights();
  const model::ModelSpec spec(w.config);
  const auto range = partition::uniform(spec, 2).stage(0);
  const int layer = range.last;  // stage 1's first decoder
  std::vector<std::byte> image, rows;
  std::optional<runtime::InferenceStage<>> st;
  st.emplace(w, range, kCaps, model::SamplerConfig{});
  image.resize(st->migration_weight_bytes(layer));
  st->read_migration_weights(layer, 0, image);
  rows.assign(st->kv_position_bytes() * 8192, std::byte{1});
  std::size_t bytes = 0;
  if (recycled) {  // a move there and back: the stage's spares hold the layer's memory
    adopt(*st, layer, image, rows);
    st->drop(layer);
  }
  for (auto _ : state) {
    if (!recycled) {
      state.PauseTiming();
      st.reset();
      st.emplace(w, range, kCaps, model::SamplerConfig{});
      state.ResumeTiming();
    }
    bytes += adopt(*st, layer, image, rows);
    state.PauseTiming();
    if (st->range().last != layer + 1) state.SkipWithError("the layer was not adopted");
    st->drop(layer);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  state.counters["seconds_per_MiB"] = benchmark::Counter(
      static_cast<double>(bytes) / (1 << 20),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

}  // namespace

BENCHMARK_CAPTURE(BM_AdoptLayer, fresh, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_AdoptLayer, recycled, true)->Unit(benchmark::kMillisecond)->UseRealTime();

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  brigade::bench::add_machine_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
