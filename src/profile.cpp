// DeviceProfile: JSON schema, look-ups, and measure_profile() on this machine.
#include "brigade/cost/profile.hpp"

#include "brigade/cost/link_probe.hpp"

#include "brigade/backend/cpu.hpp"
#include "brigade/backend/cpu_train.hpp"
#include "brigade/io/input.hpp"
#include "brigade/io/trace.hpp"
#include "brigade/transport/in_process.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <chrono>
#include <cmath>
#include <ctime>
#include <limits>
#include <thread>
#include <vector>

namespace brigade::cost {
inline namespace v0 {
namespace {

bool positive(double x) { return x > 0.0 && std::isfinite(x); }

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

using detail::typical_seconds;

// JSON readers that name the field.
const nlohmann::json& field(const nlohmann::json& j, std::string_view key, std::string_view where,
                            std::string_view path) {
  BRIGADE_CHECK(j.is_object() && j.contains(key), Errc::InvalidArgument,
                "{}: field '{}{}' is missing", where, path, key);
  return j.at(std::string(key));
}
double number(const nlohmann::json& j, std::string_view key, std::string_view where,
              std::string_view path = "") {
  const auto& v = field(j, key, where, path);
  BRIGADE_CHECK(v.is_number(), Errc::InvalidArgument, "{}: field '{}{}' is {}, expected a number",
                where, path, key, ::brigade::detail::excerpt(v.dump()));
  return v.get<double>();
}
std::string text(const nlohmann::json& j, std::string_view key, std::string_view where,
                 std::string_view path = "") {
  const auto& v = field(j, key, where, path);
  BRIGADE_CHECK(v.is_string(), Errc::InvalidArgument, "{}: field '{}{}' is {}, expected a string",
                where, path, key, ::brigade::detail::excerpt(v.dump()));
  return v.get<std::string>();
}
const nlohmann::json& array(const nlohmann::json& j, std::string_view key, std::string_view where) {
  const auto& v = field(j, key, where, "");
  BRIGADE_CHECK(v.is_array(), Errc::InvalidArgument, "{}: field '{}' is not a list", where, key);
  return v;
}
/// A whole number in [lo, hi] (JSON numbers are doubles).
template <class I>
I whole(const nlohmann::json& j, std::string_view key, std::string_view where,
        std::string_view path, double lo, double hi) {
  const double x = number(j, key, where, path);
  BRIGADE_CHECK(std::isfinite(x) && x == std::floor(x) && x >= lo && x <= hi,
                Errc::InvalidArgument, "{}: field '{}{}' = {}, expected a whole number in [{}, {}]",
                where, path, key, x, lo, hi);
  return static_cast<I>(x);
}

/// The phases a GEMM point may name, and those an attention point may name.
constexpr std::array<model::Phase, 3> kProducts = {
    model::Phase::Forward, model::Phase::BackwardInput, model::Phase::BackwardWeight};
constexpr std::array<model::Phase, 3> kAttentionPhases = {
    model::Phase::Decode, model::Phase::Forward, model::Phase::BackwardInput};

template <std::size_t N>
bool one_of(model::Phase p, const std::array<model::Phase, N>& allowed) {
  return std::find(allowed.begin(), allowed.end(), p) != allowed.end();
}

template <std::size_t N>
model::Phase phase_named(const nlohmann::json& j, std::string_view key, std::string_view where,
                         std::string_view path, const std::array<model::Phase, N>& allowed) {
  const std::string name = text(j, key, where, path);
  for (auto p : allowed)
    if (model::to_string(p) == name) return p;
  std::string expect;
  for (auto p : allowed) expect += fmt::format("{}'{}'", expect.empty() ? "" : ", ", model::to_string(p));
  ::brigade::detail::fail(Errc::InvalidArgument, "{}: field '{}{}' = '{}', expected one of {}",
                          where, path, key, ::brigade::detail::excerpt(name), expect);
}

}  // namespace

void DeviceProfile::validate() const {
  auto need = [&](bool ok, std::string_view f, double v, std::string_view expect) {
    BRIGADE_CHECK(ok, Errc::InvalidArgument, "profile '{}': field '{}' = {}, expected {}", name, f,
                  v, expect);
  };
  BRIGADE_CHECK(kind == "cpu" || kind == "gpu", Errc::InvalidArgument,
                "profile '{}': field 'kind' = '{}', expected 'cpu' or 'gpu'", name,
                ::brigade::detail::excerpt(kind));
  BRIGADE_CHECK(!name.empty() && !dtype.empty(), Errc::InvalidArgument,
                "profile: fields 'name' and 'dtype' must not be empty (name '{}', dtype '{}')",
                name, dtype);
  need(cores >= 1, "cores", cores, ">= 1");
  need(positive(core_bytes_per_s), "core_bytes_per_s", core_bytes_per_s, "> 0");
  need(positive(memory_bytes_per_s), "memory_bytes_per_s", memory_bytes_per_s, "> 0");
  need(positive(memory_capacity_bytes), "memory_capacity_bytes", memory_capacity_bytes, "> 0");
  need(positive(disk_bytes_per_s), "disk_bytes_per_s", disk_bytes_per_s, "> 0");
  BRIGADE_CHECK(!gemm.empty() && !attention.empty() && !links.empty(), Errc::InvalidArgument,
                "profile '{}': 'gemm', 'attention' and 'links' need at least one entry each "
                "({}, {}, {})",
                name, gemm.size(), attention.size(), links.size());
  for (auto product : kProducts)
    BRIGADE_CHECK(std::any_of(gemm.begin(), gemm.end(),
                              [&](const GemmPoint& g) { return g.product == product; }),
                  Errc::InvalidArgument, "profile '{}': field 'gemm' has no '{}' product", name,
                  model::to_string(product));
  for (auto phase : kAttentionPhases)
    BRIGADE_CHECK(std::any_of(attention.begin(), attention.end(),
                              [&](const AttentionPoint& a) { return a.phase == phase; }),
                  Errc::InvalidArgument, "profile '{}': field 'attention' has no '{}' phase",
                  name, model::to_string(phase));
  for (std::size_t i = 0; i < gemm.size(); ++i) {
    const auto& g = gemm[i];
    BRIGADE_CHECK(one_of(g.product, kProducts), Errc::InvalidArgument,
                  "profile '{}': field 'gemm[{}].product' = '{}', expected forward, "
                  "backward_input or backward_weight",
                  name, i, model::to_string(g.product));
    need(g.rows >= 1, fmt::format("gemm[{}].rows", i), static_cast<double>(g.rows), ">= 1");
    need(g.threads >= 1, fmt::format("gemm[{}].threads", i), g.threads, ">= 1");
    need(g.busy_cores == 0 || g.busy_cores >= g.threads, fmt::format("gemm[{}].busy_cores", i),
         g.busy_cores, "0 (the product alone) or >= threads");
    need(positive(g.flops_per_s), fmt::format("gemm[{}].flops_per_s", i), g.flops_per_s, "> 0");
  }
  for (std::size_t i = 0; i < attention.size(); ++i) {
    const auto& a = attention[i];
    BRIGADE_CHECK(one_of(a.phase, kAttentionPhases), Errc::InvalidArgument,
                  "profile '{}': field 'attention[{}].phase' = '{}', expected decode, forward or "
                  "backward_input",
                  name, i, model::to_string(a.phase));
    need(a.context >= 1, fmt::format("attention[{}].context", i), static_cast<double>(a.context),
         ">= 1");
    need(a.head_dim >= 1, fmt::format("attention[{}].head_dim", i), a.head_dim, ">= 1");
    need(positive(a.seconds_per_token_head), fmt::format("attention[{}].seconds_per_token_head", i),
         a.seconds_per_token_head, "> 0");
  }
  for (std::size_t i = 0; i < links.size(); ++i) {
    const auto& l = links[i];
    BRIGADE_CHECK(!l.transport.empty(), Errc::InvalidArgument,
                  "profile '{}': field 'links[{}].transport' is empty", name, i);
    need(l.latency_s >= 0.0 && std::isfinite(l.latency_s), fmt::format("links[{}].latency_s", i),
         l.latency_s, "finite and >= 0");
    need(positive(l.bytes_per_s), fmt::format("links[{}].bytes_per_s", i), l.bytes_per_s, "> 0");
  }
}

double DeviceProfile::gemm_flops_per_s(std::int64_t rows, int threads, model::Phase product,
                                       int busy_cores) const {
  BRIGADE_CHECK(rows >= 1 && threads >= 1 && busy_cores >= 0, Errc::InvalidArgument,
                "profile '{}': a product of {} rows on {} threads with {} cores busy, expected "
                "rows and threads >= 1, busy cores >= 0",
                name, rows, threads, busy_cores);
  BRIGADE_CHECK(one_of(product, kProducts), Errc::InvalidArgument,
                "profile '{}': no '{}' product (forward, backward_input, backward_weight)", name,
                model::to_string(product));
  // The thread count to read: the largest measured <= threads, else the smallest measured.
  int use = std::numeric_limits<int>::max(), below = 0;
  for (const auto& g : gemm) {
    if (g.product != product) continue;
    use = std::min(use, g.threads);
    if (g.threads <= threads) below = std::max(below, g.threads);
  }
  if (below > 0) use = below;
  // The busy-core count to read: the largest measured <= busy_cores, else the product alone.
  const auto busy_of = [](const GemmPoint& g) {
    return g.busy_cores == 0 ? g.threads : g.busy_cores;
  };
  int busy = use;
  for (const auto& g : gemm)
    if (g.product == product && g.threads == use && busy_of(g) <= std::max(busy_cores, use))
      busy = std::max(busy, busy_of(g));
  // The measured row counts around `rows` (one pass, no allocation: planners call this for
  // every layer of every candidate): lo the largest below, hi the smallest at or above.
  const GemmPoint *lo = nullptr, *hi = nullptr;
  for (const auto& g : gemm) {
    if (g.product != product || g.threads != use || busy_of(g) != busy) continue;
    if (g.rows < rows) {
      if (lo == nullptr || g.rows > lo->rows) lo = &g;
    } else if (hi == nullptr || g.rows < hi->rows) {
      hi = &g;
    }
  }
  BRIGADE_CHECK(lo != nullptr || hi != nullptr, Errc::InvalidArgument,
                "profile '{}' has no '{}' product points", name, model::to_string(product));
  if (hi == nullptr) return lo->flops_per_s;  // past the largest measured
  if (lo == nullptr) return hi->flops_per_s;  // at or below the smallest measured
  // Linear in log(rows) between the two.
  const double x0 = std::log(static_cast<double>(lo->rows));
  const double x1 = std::log(static_cast<double>(hi->rows));
  const double t = (std::log(static_cast<double>(rows)) - x0) / (x1 - x0);
  return lo->flops_per_s + t * (hi->flops_per_s - lo->flops_per_s);
}

double DeviceProfile::attention_seconds(std::int64_t tokens, int heads, int head_dim,
                                        double context, model::Phase phase) const {
  BRIGADE_CHECK(tokens >= 1 && heads >= 1 && head_dim >= 1 && context >= 1.0,
                Errc::InvalidArgument,
                "profile '{}': attention of {} tokens, {} heads of {}, context {}; expected all "
                ">= 1",
                name, tokens, heads, head_dim, context);
  std::vector<const AttentionPoint*> pts;
  for (const auto& a : attention)
    if (a.phase == phase) pts.push_back(&a);
  BRIGADE_CHECK(!pts.empty(), Errc::InvalidArgument,
                "profile '{}' has no '{}' attention points (decode, forward, backward_input)",
                name, model::to_string(phase));
  std::sort(pts.begin(), pts.end(), [](auto* a, auto* b) { return a->context < b->context; });
  auto per = [&](const AttentionPoint& p) {
    return p.seconds_per_token_head * static_cast<double>(head_dim) / p.head_dim;
  };
  double s;
  if (context <= static_cast<double>(pts.front()->context)) {
    s = per(*pts.front());
  } else if (context >= static_cast<double>(pts.back()->context)) {
    s = per(*pts.back()) * context / static_cast<double>(pts.back()->context);
  } else {
    std::size_t i = 1;
    while (static_cast<double>(pts[i]->context) < context) ++i;
    const double c0 = static_cast<double>(pts[i - 1]->context);
    const double c1 = static_cast<double>(pts[i]->context);
    s = per(*pts[i - 1]) + (context - c0) / (c1 - c0) * (per(*pts[i]) - per(*pts[i - 1]));
  }
  return s * static_cast<double>(tokens) * heads;
}

const LinkProfile& DeviceProfile::link(std::string_view transport) const {
  std::string known;
  for (const auto& l : links) {
    if (l.transport == transport) return l;
    known += (known.empty() ? "" : ", ") + l.transport;
  }
  ::brigade::detail::fail(Errc::InvalidArgument,
                          "profile '{}' has no link '{}' (it has: {})", name,
                          ::brigade::detail::excerpt(transport), known);
}

void DeviceProfile::check_fits(double bytes, std::string_view what) const {
  BRIGADE_CHECK(bytes <= memory_capacity_bytes, Errc::InvalidArgument,
                "{}: {:.0f} bytes do not fit in {}'s {:.0f} bytes of memory", what, bytes, name,
                memory_capacity_bytes);
}

nlohmann::json to_json(const DeviceProfile& p) {
  nlohmann::json gemm = nlohmann::json::array(), att = nlohmann::json::array(),
                 links = nlohmann::json::array();
  for (const auto& g : p.gemm)
    gemm.push_back({{"product", model::to_string(g.product)},
                    {"rows", g.rows},
                    {"threads", g.threads},
                    {"flops_per_s", g.flops_per_s}});
  for (std::size_t i = 0; i < p.gemm.size(); ++i)
    if (p.gemm[i].busy_cores != 0) gemm[i]["busy_cores"] = p.gemm[i].busy_cores;
  for (const auto& a : p.attention)
    att.push_back({{"phase", model::to_string(a.phase)},
                   {"context", a.context},
                   {"head_dim", a.head_dim},
                   {"seconds_per_token_head", a.seconds_per_token_head}});
  for (const auto& l : p.links)
    links.push_back(
        {{"transport", l.transport}, {"latency_s", l.latency_s}, {"bytes_per_s", l.bytes_per_s}});
  return {{"schema", kProfileSchema},
          {"name", p.name},
          {"kind", p.kind},
          {"source", p.source},
          {"dtype", p.dtype},
          {"cores", p.cores},
          {"gemm", gemm},
          {"attention", att},
          {"core_bytes_per_s", p.core_bytes_per_s},
          {"memory_bytes_per_s", p.memory_bytes_per_s},
          {"memory_capacity_bytes", p.memory_capacity_bytes},
          {"disk_bytes_per_s", p.disk_bytes_per_s},
          {"links", links}};
}

DeviceProfile profile_from_json(const nlohmann::json& j, std::string_view where) {
  BRIGADE_CHECK(j.is_object(), Errc::InvalidArgument, "{}: a profile is a JSON object", where);
  const std::string schema = text(j, "schema", where);
  BRIGADE_CHECK(schema == kProfileSchema, Errc::InvalidArgument,
                "{}: field 'schema' = '{}', expected '{}'", where,
                ::brigade::detail::excerpt(schema), kProfileSchema);
  // Every key is known: a misspelled field is named, not ignored.
  static constexpr std::array<std::string_view, 13> kKeys = {
      "schema", "name", "kind", "source", "dtype", "cores", "gemm", "attention",
      "core_bytes_per_s", "memory_bytes_per_s", "memory_capacity_bytes", "disk_bytes_per_s",
      "links"};
  for (const auto& [key, value] : j.items())
    BRIGADE_CHECK(std::find(kKeys.begin(), kKeys.end(), key) != kKeys.end(),
                  Errc::InvalidArgument, "{}: unknown field '{}' (the schema's fields: {})", where,
                  ::brigade::detail::excerpt(key), fmt::join(kKeys, ", "));
  DeviceProfile p;
  p.name = text(j, "name", where);
  p.kind = text(j, "kind", where);
  p.source = text(j, "source", where);
  p.dtype = text(j, "dtype", where);
  p.cores = whole<int>(j, "cores", where, "", 1, 1 << 20);
  const auto& gemm = array(j, "gemm", where);
  for (std::size_t i = 0; i < gemm.size(); ++i) {
    const std::string at = fmt::format("gemm[{}].", i);
    p.gemm.push_back({phase_named(gemm[i], "product", where, at, kProducts),
                      whole<std::int64_t>(gemm[i], "rows", where, at, 1, 1e12),
                      whole<int>(gemm[i], "threads", where, at, 1, 1 << 20),
                      number(gemm[i], "flops_per_s", where, at),
                      gemm[i].is_object() && gemm[i].contains("busy_cores")
                          ? whole<int>(gemm[i], "busy_cores", where, at, 0, 1 << 20)
                          : 0});
  }
  const auto& att = array(j, "attention", where);
  for (std::size_t i = 0; i < att.size(); ++i) {
    const std::string at = fmt::format("attention[{}].", i);
    p.attention.push_back({phase_named(att[i], "phase", where, at, kAttentionPhases),
                           whole<std::int64_t>(att[i], "context", where, at, 1, 1e12),
                           whole<int>(att[i], "head_dim", where, at, 1, 1 << 16),
                           number(att[i], "seconds_per_token_head", where, at)});
  }
  p.core_bytes_per_s = number(j, "core_bytes_per_s", where);
  p.memory_bytes_per_s = number(j, "memory_bytes_per_s", where);
  p.memory_capacity_bytes = number(j, "memory_capacity_bytes", where);
  p.disk_bytes_per_s = number(j, "disk_bytes_per_s", where);
  const auto& links = array(j, "links", where);
  for (std::size_t i = 0; i < links.size(); ++i) {
    const std::string at = fmt::format("links[{}].", i);
    p.links.push_back({text(links[i], "transport", where, at),
                       number(links[i], "latency_s", where, at),
                       number(links[i], "bytes_per_s", where, at)});
  }
  try {
    p.validate();
  } catch (const Error& e) {
    ::brigade::detail::fail(Errc::InvalidArgument, "{}: {}", where, e.what());
  }
  return p;
}

DeviceProfile load_profile(const std::filesystem::path& path) {
  const std::string body = io::read_input_file(path, "profile", std::uint64_t{16} << 20);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::exception& e) {
    ::brigade::detail::fail(Errc::BadFile, "profile {}: not JSON ({})", path.string(), e.what());
  }
  return profile_from_json(j, path.string());
}

void save_profile(const std::filesystem::path& path, const DeviceProfile& p) {
  p.validate();
  io::write_file_atomic(path, to_json(p).dump(2) + "\n");
}

namespace {

/// Sum over `threads` threads, each running `fn(t)` at once, of work / its typical (median) time.
template <class Fn>
double concurrent_rate(int threads, double work, double budget, Fn fn) {
  std::vector<double> rate(static_cast<std::size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { rate[static_cast<std::size_t>(t)] = work / fn(t, budget); });
  for (auto& th : pool) th.join();
  double sum = 0.0;
  for (double r : rate) sum += r;
  return sum;
}

double triad(int threads, std::int64_t bytes, double budget) {
  const auto n = static_cast<std::size_t>(std::max<std::int64_t>(bytes / 12, 1024));
  return concurrent_rate(threads, 12.0 * static_cast<double>(n), budget, [n](int, double b) {
    std::vector<float> a(n, 0.0f), x(n, 1.0f), y(n, 2.0f);
    return typical_seconds(b, [&] {
      for (std::size_t i = 0; i < n; ++i) a[i] = x[i] + 3.0f * y[i];
      asm volatile("" ::"r"(a.data()) : "memory");
    });
  });
}

double disk_read(const ProfileOptions& o, std::string& note) {
  std::error_code ec;
  const auto dir = o.disk_dir.empty() ? std::filesystem::temp_directory_path(ec) : o.disk_dir;
  BRIGADE_CHECK(!ec, Errc::BadFile,
                "profile: no temporary directory for the disk file ({}); give a disk directory "
                "(brigade profile --disk-dir, ProfileOptions::disk_dir)",
                ec.message());
  const auto path = dir / fmt::format("brigade-profile-{}.bin", ::getpid());
  const std::size_t chunk = std::size_t{4} << 20;
  std::vector<char> buf(chunk, 'b');
  const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
  BRIGADE_CHECK(fd >= 0, Errc::BadFile, "profile: cannot write {} to time the disk", path.string());
  std::int64_t left = o.disk_bytes;
  bool ok = true;
  while (ok && left > 0) {
    const auto n = static_cast<std::size_t>(std::min<std::int64_t>(left, static_cast<std::int64_t>(chunk)));
    ok = ::write(fd, buf.data(), n) == static_cast<ssize_t>(n);
    left -= static_cast<std::int64_t>(n);
  }
  ok = ok && ::fsync(fd) == 0;
  const bool dropped = ok && ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0;
  ::close(fd);
  if (!ok) {
    std::filesystem::remove(path);
    ::brigade::detail::fail(Errc::BadFile, "profile: cannot write {} bytes to {}", o.disk_bytes,
                            path.string());
  }
  const int rfd = ::open(path.c_str(), O_RDONLY);
  const double t0 = now_s();
  std::int64_t got = 0;
  for (ssize_t n; rfd >= 0 && (n = ::read(rfd, buf.data(), chunk)) > 0;) got += n;
  const double dt = now_s() - t0;
  if (rfd >= 0) ::close(rfd);
  std::filesystem::remove(path);
  BRIGADE_CHECK(got == o.disk_bytes, Errc::BadFile, "profile: read back {} of {} bytes from {}",
                got, o.disk_bytes, path.string());
  note = dropped ? "read after fsync and POSIX_FADV_DONTNEED" : "page cache (fadvise refused)";
  return static_cast<double>(got) / std::max(dt, 1e-9);
}

LinkProfile in_process_link(double budget) {
  transport::InProcessFabric fabric(2);
  std::thread echo([&] {
    transport::InProcessTransport tp(fabric, 1);
    (void)measure_link(tp, 0, false, "in-process", budget);
  });
  transport::InProcessTransport tp(fabric, 0);
  LinkProfile link = measure_link(tp, 1, true, "in-process", budget);
  echo.join();
  return link;
}

}  // namespace

DeviceProfile measure_profile(const ProfileOptions& o) {
  BRIGADE_CHECK(o.cores >= 1 && !o.rows.empty() && !o.contexts.empty() &&
                    !o.backward_rows.empty() && !o.training_contexts.empty() && o.gemm_in >= 1 &&
                    o.gemm_out >= 1 && o.head_dim >= 1 && o.stream_bytes >= 1 &&
                    o.disk_bytes >= 1 && o.seconds_per_point > 0.0,
                Errc::InvalidArgument,
                "measure_profile: cores {}, {} row counts, {} backward row counts, {} contexts, {} "
                "training contexts, gemm {} x {}, head_dim {}, stream {} B, disk {} B, {} s per "
                "point; expected all >= 1 (and > 0 s)",
                o.cores, o.rows.size(), o.backward_rows.size(), o.contexts.size(),
                o.training_contexts.size(), o.gemm_in, o.gemm_out, o.head_dim,
                o.stream_bytes, o.disk_bytes, o.seconds_per_point);
  for (const auto* rows : {&o.rows, &o.backward_rows})
    for (auto r : *rows)
      BRIGADE_CHECK(r >= 1, Errc::InvalidArgument, "measure_profile: rows {} < 1", r);
  for (const auto* contexts : {&o.contexts, &o.training_contexts})
    for (auto c : *contexts)
      BRIGADE_CHECK(c >= 1, Errc::InvalidArgument, "measure_profile: context {} < 1", c);
  DeviceProfile p;
  p.kind = "cpu";
  p.dtype = "f32";
  p.cores = o.cores;
  p.name = fmt::format("{} ({} cores, {} decode kernel)", cpu::cpu_model_name(), o.cores,
                       cpu::to_string(cpu::kernel_isa()));
  const double budget = o.seconds_per_point;
  const int threads_before = cpu::blas_threads();

  // Products: a weight of gemm_out x gemm_in read by `rows` activation rows, on 1 thread and on
  // `cores` intra-op threads. Each repetition reads the next of as many copies of the weight as
  // fill options.stream_bytes, so weights come from memory as a model's do (a model's layers
  // are larger than the caches), not from a cache that one small weight would fit in.
  const auto wsize = static_cast<std::size_t>(o.gemm_out * o.gemm_in);
  const std::size_t copies = std::max<std::size_t>(
      1, static_cast<std::size_t>(o.stream_bytes) / (wsize * sizeof(float)));
  std::vector<float> w(wsize * copies, 0.25f);
  // Each product on 1 thread alone, on 1 thread while the other cores run products too (the
  // rate of one stage of a pipeline that keeps every core busy: GemmPoint::busy_cores), and on
  // `cores` intra-op threads.
  struct Config {
    int threads, busy;
  };
  std::vector<Config> configs{{1, 0}};
  if (o.cores > 1) configs.insert(configs.end(), {{1, o.cores}, {o.cores, 0}});
  // The other cores' work during a busy point: forward products of the same rows over their
  // own weight copies (together the size of the stream), so they stream memory as a stage does.
  std::vector<float> others_w(o.cores > 1 ? wsize * copies : 0, 0.25f);
  const std::size_t others_copies = std::max<std::size_t>(1, copies / std::max(1, o.cores - 1));
  for (const Config cfg : configs) {
    const int threads = cfg.threads;
    cpu::set_blas_threads(threads);
    const auto busy_while = [&](std::int64_t rows, auto&& measure) {
      if (cfg.busy == 0) return measure();
      std::atomic<bool> stop{false};
      std::vector<std::thread> others;
      for (int t = 0; t + 1 < cfg.busy; ++t)
        others.emplace_back([&, t] {
          std::vector<float> x(static_cast<std::size_t>(rows * o.gemm_in), 0.5f),
              y(static_cast<std::size_t>(rows * o.gemm_out));
          const float* base =
              others_w.data() + wsize * ((static_cast<std::size_t>(t) * others_copies) % copies);
          for (std::size_t next = 0; !stop.load(std::memory_order_relaxed);
               next = (next + 1) % others_copies)
            cpu::matmul_wt(x.data(), base + wsize * next, y.data(), rows, o.gemm_in, o.gemm_out);
        });
      const double seconds = measure();
      stop.store(true);
      for (auto& th : others) th.join();
      return seconds;
    };
    for (auto rows : o.rows) {
      std::vector<float> x(static_cast<std::size_t>(rows * o.gemm_in), 0.5f),
          y(static_cast<std::size_t>(rows * o.gemm_out));
      std::size_t next = 0;
      const double s = busy_while(rows, [&] {
        return typical_seconds(budget, [&] {
          cpu::matmul_wt(x.data(), w.data() + wsize * next, y.data(), rows, o.gemm_in, o.gemm_out);
          next = (next + 1) % copies;
        });
      });
      p.gemm.push_back({model::Phase::Forward, rows, threads,
                        2.0 * static_cast<double>(rows * o.gemm_in * o.gemm_out) / s, cfg.busy});
    }
    // Training products: dx = dy W reads the weight copies as the forward does; dW += dy^T x
    // writes into the next gradient copy (a stage accumulates into every layer's gradients).
    for (auto rows : o.backward_rows) {
      std::vector<float> dy(static_cast<std::size_t>(rows * o.gemm_out), 0.5f),
          x(static_cast<std::size_t>(rows * o.gemm_in), 0.5f),
          dx(static_cast<std::size_t>(rows * o.gemm_in));
      const double flops = 2.0 * static_cast<double>(rows * o.gemm_in * o.gemm_out);
      std::size_t next = 0;
      const double si = busy_while(rows, [&] {
        return typical_seconds(budget, [&] {
          cpu::matmul_wt_backward_input(dy.data(), w.data() + wsize * next, dx.data(), rows,
                                        o.gemm_in, o.gemm_out);
          next = (next + 1) % copies;
        });
      });
      p.gemm.push_back({model::Phase::BackwardInput, rows, threads, flops / si, cfg.busy});
      const double sw = busy_while(rows, [&] {
        return typical_seconds(budget, [&] {
          cpu::matmul_wt_backward_weight(dy.data(), x.data(), w.data() + wsize * next, rows,
                                         o.gemm_in, o.gemm_out);
          next = (next + 1) % copies;
        });
      });
      p.gemm.push_back({model::Phase::BackwardWeight, rows, threads, flops / sw, cfg.busy});
    }
  }
  cpu::set_blas_threads(1);

  // Decode attention: one query token of 8 heads against `context` cached rows.
  constexpr int heads = 8;
  for (auto ctx : o.contexts) {
    const auto row = static_cast<std::size_t>(heads * o.head_dim);
    std::vector<float> q(row, 0.01f), k(row * static_cast<std::size_t>(ctx), 0.02f),
        v(row * static_cast<std::size_t>(ctx), 0.03f), out(row);
    const double s = typical_seconds(budget, [&] {
      cpu::attention(q.data(), k.data(), v.data(), out.data(), 1, ctx - 1, heads, heads,
                     o.head_dim);
    });
    p.attention.push_back({model::Phase::Decode, ctx, o.head_dim, s / heads});
  }
  // Training attention: one packed sequence of 2 c - 1 tokens (mean context c), forward with
  // the log-sum-exp kept, then its backward.
  for (auto ctx : o.training_contexts) {
    const std::int64_t n = 2 * ctx - 1;
    const auto size = static_cast<std::size_t>(n * heads * o.head_dim);
    std::vector<float> q(size, 0.01f), k(size, 0.02f), v(size, 0.03f), out(size), dout(size, 0.1f),
        dq(size), dk(size), dv(size), lse(static_cast<std::size_t>(n * heads));
    const std::array<std::int64_t, 2> offsets{0, n};
    const double sf = typical_seconds(budget, [&] {
      cpu::attention_varlen_forward(q.data(), k.data(), v.data(), out.data(), lse.data(),
                                    offsets, heads, heads, o.head_dim);
    });
    const double sb = typical_seconds(budget, [&] {
      cpu::attention_varlen_backward(q.data(), k.data(), v.data(), out.data(), lse.data(),
                                     dout.data(), dq.data(), dk.data(), dv.data(), offsets, heads,
                                     heads, o.head_dim);
    });
    const double per = static_cast<double>(n) * heads;
    p.attention.push_back({model::Phase::Forward, ctx, o.head_dim, sf / per});
    p.attention.push_back({model::Phase::BackwardInput, ctx, o.head_dim, sb / per});
  }
  cpu::set_blas_threads(threads_before);

  p.core_bytes_per_s = triad(1, o.stream_bytes, budget);
  p.memory_bytes_per_s = o.cores > 1 ? triad(o.cores, o.stream_bytes, budget) : p.core_bytes_per_s;
  p.memory_capacity_bytes = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                            static_cast<double>(::sysconf(_SC_PAGESIZE));
  std::string disk_note;
  p.disk_bytes_per_s = disk_read(o, disk_note);
  p.links.push_back(in_process_link(budget));

  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  p.source = fmt::format(
      "measured by brigade profile on {} (products {} x {} f32 over {} MiB of weight copies; "
      "triad {} MiB per thread; {} s per point; disk {} MiB, {})",
      date, o.gemm_out, o.gemm_in, (wsize * copies * sizeof(float)) >> 20, o.stream_bytes >> 20,
      o.seconds_per_point, o.disk_bytes >> 20, disk_note);
  p.validate();
  return p;
}

}  // namespace v0
}  // namespace brigade::cost
