// Stage-to-stage transport: ping-pong latency and bandwidth of a message of S bytes between two
// ranks, for S = 4 KiB .. 64 MiB.
//
// Scenarios (one binary, two ways to start it):
//   BM_PingPong/in_process/S   two threads of this process over an InProcessTransport (always)
//   BM_PingPong/mpi/S          rank 0 and rank 1 of an MpiTransport, one process each (only under
//                              `mpirun -np 2 bench_transport`; rank 0 reports, rank 1 echoes)
//   BM_PingPong/raw_mpi/S      the same two processes with bare MPI_Isend/MPI_Irecv/MPI_Waitall
//                              on MPI_COMM_WORLD: the floor MpiTransport adds its record, header
//                              check and polling to (only under mpirun -np 2)
// Each iteration sends S bytes to the echo rank and waits for the same S bytes back.
// Counters: one_way = iteration time / 2 (seconds); bandwidth = S / one_way, bytes per second
// (the message bandwidth of one direction, binary prefixes). After the timed loop the echoed bytes are checked; a wrong
// echo fails the benchmark (SkipWithError).
//
//   build/bench/bench_transport --benchmark_min_time=0.2                 # in-process only
//   mpirun -np 2 build/bench/bench_transport --benchmark_min_time=0.2    # both, same run
#include <brigade/config.hpp>
#include <brigade/transport/in_process.hpp>
#include <brigade/transport/mpi.hpp>

#include <benchmark/benchmark.h>
#include <fmt/core.h>
#if BRIGADE_HAS_MPI
#include <mpi.h>
#endif

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

namespace {

using brigade::DType;
using namespace brigade::transport;

constexpr std::int64_t kMaxBytes = std::int64_t{64} << 20;
constexpr std::int64_t kData = 1;  // micro-batch id of a ping
constexpr std::int64_t kStop = 2;  // micro-batch id that ends the echo loop

MessageHeader ping_header(std::int64_t microbatch, std::int64_t bytes) {
  return MessageHeader::make(microbatch, 1, DType::U8, {bytes});
}

/// Rank 1's side: receives any ping from rank 0 and sends it back, until a stop message.
template <Transport T>
void echo_loop(T& t) {
  std::vector<std::byte> buf(static_cast<std::size_t>(kMaxBytes));
  for (;;) {
    auto r = t.irecv(0, 0, MessageHeader::make(kAny, 1, DType::U8, {kAny}), buf);
    t.wait(r, Deadline::never());
    if (r.header.microbatch == kStop) return;
    const auto n = static_cast<std::size_t>(r.header.nbytes());
    auto s = t.isend(0, 0, r.header, ConstBytes(buf.data(), n));
    t.wait(s, Deadline::never());
  }
}

/// One round trip of the largest size, so that the first timed benchmark does not pay for the
/// echo rank's start-up (its 64 MiB buffer, thread or process start).
template <Transport T>
void warm_up(T& t) {
  std::vector<std::byte> buf(static_cast<std::size_t>(kMaxBytes));
  const auto h = ping_header(kData, kMaxBytes);
  auto r = t.irecv(1, 0, h, buf);
  auto s = t.isend(1, 0, h, buf);
  t.wait(s, Deadline::after(120));
  t.wait(r, Deadline::after(120));
}

template <Transport T>
void stop_echo(T& t) {
  auto s = t.isend(1, 0, ping_header(kStop, 0), {});
  t.wait(s, Deadline::after(60));
}

/// Rank 0's side of one benchmark: ping-pong of state.range(0) bytes.
template <Transport T>
void ping_pong(benchmark::State& state, T& t) {
  const auto bytes = state.range(0);
  std::vector<std::byte> out(static_cast<std::size_t>(bytes)), back(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>(i * 131 + 7);
  const auto h = ping_header(kData, bytes);
  for (auto _ : state) {
    auto r = t.irecv(1, 0, h, back);
    auto s = t.isend(1, 0, h, out);
    t.wait(s, Deadline::after(60));
    t.wait(r, Deadline::after(60));
  }
  if (back != out) state.SkipWithError("the echoed bytes differ from the ones sent");
  state.counters["one_way"] = benchmark::Counter(
      2.0 * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["bandwidth"] = benchmark::Counter(
      2.0 * static_cast<double>(state.iterations() * bytes), benchmark::Counter::kIsRate,
      benchmark::Counter::kIs1024);
}

/// The in-process pair: rank 0 here, rank 1 on an echo thread, over one fabric.
struct InProcessPair {
  InProcessFabric fabric{2};
  InProcessTransport client{fabric, 0};
  std::jthread server{[this] {
    InProcessTransport t(fabric, 1);
    echo_loop(t);
  }};
  ~InProcessPair() { stop_echo(client); }
};

#if BRIGADE_HAS_MPI
constexpr int kRawTag = 7, kRawStop = 8;

/// Rank 1's side of the bare-MPI ping-pong: echoes every message with its tag until kRawStop.
void raw_echo_loop() {
  std::vector<std::byte> buf(static_cast<std::size_t>(kMaxBytes));
  for (;;) {
    MPI_Status st;
    MPI_Recv(buf.data(), static_cast<int>(buf.size()), MPI_BYTE, 0, MPI_ANY_TAG, MPI_COMM_WORLD,
             &st);
    if (st.MPI_TAG == kRawStop) return;
    int n = 0;
    MPI_Get_count(&st, MPI_BYTE, &n);
    MPI_Send(buf.data(), n, MPI_BYTE, 0, kRawTag, MPI_COMM_WORLD);
  }
}

/// Rank 0's side of the bare-MPI ping-pong of state.range(0) bytes.
void raw_ping_pong(benchmark::State& state) {
  const auto bytes = state.range(0);
  std::vector<std::byte> out(static_cast<std::size_t>(bytes)), back(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>(i * 131 + 7);
  const int n = static_cast<int>(bytes);
  for (auto _ : state) {
    MPI_Request req[2];
    MPI_Irecv(back.data(), n, MPI_BYTE, 1, kRawTag, MPI_COMM_WORLD, &req[0]);
    MPI_Isend(out.data(), n, MPI_BYTE, 1, kRawTag, MPI_COMM_WORLD, &req[1]);
    MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
  }
  if (back != out) state.SkipWithError("the echoed bytes differ from the ones sent");
  state.counters["one_way"] = benchmark::Counter(
      2.0 * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["bandwidth"] = benchmark::Counter(
      2.0 * static_cast<double>(state.iterations() * bytes), benchmark::Counter::kIsRate,
      benchmark::Counter::kIs1024);
}
#endif

void args(benchmark::internal::Benchmark* b) {
  b->ArgName("bytes")->RangeMultiplier(4)->Range(4 << 10, kMaxBytes)->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  auto in_process = std::make_unique<InProcessPair>();
  warm_up(in_process->client);
  benchmark::RegisterBenchmark("BM_PingPong/in_process", [&](benchmark::State& s) {
    ping_pong(s, in_process->client);
  })->Apply(args);
#if BRIGADE_HAS_MPI
  std::optional<MpiSession> mpi;
  std::optional<MpiTransport> mt;
  bool raw_mode = false;
  if (mpi_world_size_from_env() > 0) {
    mpi.emplace(&argc, &argv);
    if (mpi->world_size() != 2) {
      if (mpi->rank() == 0)
        fmt::print(stderr, "bench_transport: run with mpirun -np 2 (got {} ranks)\n",
                   mpi->world_size());
      return 1;
    }
    mt.emplace();
    if (mt->rank() == 1) {
      in_process.reset();
      echo_loop(*mt);  // until rank 0 moves on to the bare-MPI benchmarks (or ends)
      raw_echo_loop();
      mt->barrier(Deadline::after(600));
      return 0;
    }
    warm_up(*mt);
    benchmark::RegisterBenchmark("BM_PingPong/mpi", [&](benchmark::State& s) {
      ping_pong(s, *mt);
    })->Apply(args);
    benchmark::RegisterBenchmark("BM_PingPong/raw_mpi", [&](benchmark::State& s) {
      if (!raw_mode) {  // switch rank 1 from the transport echo to the bare one
        stop_echo(*mt);
        raw_mode = true;
      }
      raw_ping_pong(s);
    })->Apply(args);
  }
#endif
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
#if BRIGADE_HAS_MPI
  if (mt) {
    if (!raw_mode) stop_echo(*mt);
    MPI_Send(nullptr, 0, MPI_BYTE, 1, kRawStop, MPI_COMM_WORLD);
    mt->barrier(Deadline::after(600));
  }
#endif
  return 0;
}
