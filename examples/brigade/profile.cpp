// `brigade profile`: measures this machine into a device profile (docs/profiles.md), or checks
// a profile file.
#include "cli.hpp"

#include <brigade/cost/link_probe.hpp>
#include <brigade/cost/profile.hpp>
#include <brigade/transport/mpi.hpp>

#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <span>
#include <memory>
#include <string>

namespace {

struct ProfileArgs {
  std::string out, check;
  int cores = brigade::cli::hardware_threads();
  bool quick = false;
  std::string disk_dir;
};

void print_summary(const brigade::cost::DeviceProfile& p) {
  fmt::print(stderr, "profile: {} ({}, {}, {} cores)\n", p.name, p.kind, p.dtype, p.cores);
  for (const auto& g : p.gemm)
    fmt::print(stderr, "  gemm {:<15} {:>4} rows x {} thread(s): {:8.1f} GFLOP/s\n",
               brigade::model::to_string(g.product), g.rows, g.threads, g.flops_per_s * 1e-9);
  for (const auto& at : p.attention)
    fmt::print(stderr, "  attention {:<14} context {:>5}, head {}: {:8.2f} us per token and head\n",
               brigade::model::to_string(at.phase), at.context, at.head_dim,
               at.seconds_per_token_head * 1e6);
  fmt::print(stderr,
             "  memory: {:.1f} GB/s one core, {:.1f} GB/s all, {:.1f} GiB; disk {:.2f} GB/s\n",
             p.core_bytes_per_s / 1e9, p.memory_bytes_per_s / 1e9,
             p.memory_capacity_bytes / (1024.0 * 1024 * 1024), p.disk_bytes_per_s / 1e9);
  for (const auto& l : p.links)
    fmt::print(stderr, "  link {}: {:.2f} us, {:.2f} GB/s\n", l.transport, l.latency_s * 1e6,
               l.bytes_per_s / 1e9);
  fmt::print(stderr, "  source: {}\n", p.source);
}

int run(const ProfileArgs& a) {
  if (!a.check.empty()) {
    print_summary(brigade::cost::load_profile(a.check));
    return 0;
  }
  brigade::cost::ProfileOptions o;
  o.cores = a.cores;
  if (!a.disk_dir.empty()) o.disk_dir = a.disk_dir;
  if (a.quick) {  // a few points in well under a second, for tests and smoke checks
    o.rows = {1, 16, 64};
    o.backward_rows = {64};
    o.contexts = {64, 512};
    o.training_contexts = {32};
    o.stream_bytes = std::int64_t{12} << 20;
    o.disk_bytes = std::int64_t{8} << 20;
    o.seconds_per_point = 0.005;
  }
  const brigade::cli::MpiLaunch launch(-1);
  if (!launch.active() || launch.world() == 1) {
    const auto p = brigade::cost::measure_profile(o);
    brigade::cost::save_profile(a.out, p);
    print_summary(p);
    fmt::print(stderr, "written: {}\n", a.out);
    return 0;
  }
#if BRIGADE_HAS_MPI
  // Under mpirun: one profile per process (its device), measured one process after the other
  // (processes sharing a machine would otherwise slow each other's figures), plus the "mpi"
  // link timed between ranks 0 and 1 and handed to every rank; written to OUT.rank<r>.json.
  namespace tr = brigade::transport;
  tr::MpiTransport tp;
  const int me = tp.rank(), world = tp.world_size();
  const auto deadline = [] { return tr::Deadline::after(600.0); };
  const auto token = tr::MessageHeader::make(0, 0, brigade::DType::U8, {0});
  if (me > 0) {
    auto r = tp.irecv(me - 1, 100, token, tr::MutableBytes{});
    tp.wait(r, deadline());
  }
  auto p = brigade::cost::measure_profile(o);
  if (me + 1 < world) {
    auto s = tp.isend(me + 1, 100, token, tr::ConstBytes{});
    tp.wait(s, deadline());
  }
  brigade::cost::LinkProfile link;
  if (me <= 1) link = brigade::cost::measure_link(tp, 1 - me, me == 0, "mpi", o.seconds_per_point, 1);
  std::array<double, 2> figures{link.latency_s, link.bytes_per_s};
  const auto h = tr::MessageHeader::make(0, 0, brigade::DType::U8, {sizeof figures});
  if (me == 0) {
    for (int r = 1; r < world; ++r) {
      auto s = tp.isend(r, 101, h, tr::as_bytes(std::span<const double>(figures)));
      tp.wait(s, deadline());
    }
  } else {
    auto r = tp.irecv(0, 101, h, tr::as_writable_bytes(std::span<double>(figures)));
    tp.wait(r, deadline());
  }
  p.links.push_back({"mpi", figures[0], figures[1]});
  const std::filesystem::path out(a.out);
  const auto mine = out.parent_path() /
                    fmt::format("{}.rank{}{}", out.stem().string(), me, out.extension().string());
  brigade::cost::save_profile(mine, p);
  if (me == 0) print_summary(p);
  fmt::print(stderr, "rank {}: written: {}\n", me, mine.string());
  return 0;
#else
  return 1;  // MpiLaunch refuses mpirun without the mpi component
#endif
}

std::function<int()> setup(CLI::App& sub) {
  auto a = std::make_shared<ProfileArgs>();
  auto* out = sub.add_option("--out", a->out,
                             "write the measured profile (JSON) to this file; under mpirun each "
                             "process writes OUT.rank<r>.json, with the 'mpi' link it measured");
  auto* check = sub.add_option("--check", a->check,
                               "read a profile file (measured or hand-written), check every "
                               "field and print it");
  out->excludes(check);
  check->excludes(out);
  sub.add_option("--cores", a->cores, "cores the all-core measurements use")
      ->check(brigade::cli::threads_range())
      ->capture_default_str();
  sub.add_flag("--quick", a->quick, "a few points with short repetitions (a smoke check)");
  sub.add_option("--disk-dir", a->disk_dir,
                 "folder of the file written and read back to time the disk (default: the "
                 "temporary directory)");
  return [a, out, check] {
    if (out->count() == 0 && check->count() == 0)
      brigade::detail::fail(brigade::Errc::InvalidArgument,
                            "profile: give --out FILE to measure this machine, or --check FILE");
    return run(*a);
  };
}

const brigade::cli::Registrar registrar{
    {"profile", "Measure this machine into a device profile (JSON), or check a profile file",
     setup}};

}  // namespace
