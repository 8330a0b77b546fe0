// Halda (prima.cpp §4): the latency model, the device cases, the integer program per k solved
// by COIN-OR CBC, the case-assignment iteration and device removal.
#include "brigade/partition/halda.hpp"

#include <Cbc_C_Interface.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <optional>
#include <numeric>

namespace brigade::partition {
inline namespace v0 {

namespace {

constexpr double kInf = 1e30;  // CBC reads bounds at or past 1e30 as infinite

bool has_gpu(const HaldaDevice& d) { return d.gpu != "none"; }
bool is_macos(const HaldaDevice& d) { return d.os == "macos"; }
bool is_android(const HaldaDevice& d) { return d.os == "android"; }

void check_device(const HaldaDevice& d, std::size_t i) {
  const auto positive = [&](double v, const char* field) {
    BRIGADE_CHECK(v > 0 && std::isfinite(v), Errc::InvalidArgument,
                  "halda: device {} ({}): {} = {}, expected a positive number", i, d.name, field, v);
  };
  BRIGADE_CHECK(d.os == "macos" || d.os == "linux" || d.os == "android", Errc::InvalidArgument,
                "halda: device {} ({}): os '{}', expected macos, linux or android", i, d.name, d.os);
  BRIGADE_CHECK(d.gpu == "none" || d.gpu == "cuda" || d.gpu == "metal", Errc::InvalidArgument,
                "halda: device {} ({}): gpu '{}', expected none, cuda or metal", i, d.name, d.gpu);
  BRIGADE_CHECK(d.gpu != "metal" || is_macos(d), Errc::InvalidArgument,
                "halda: device {} ({}): gpu metal needs os macos", i, d.name);
  positive(d.cpu_flops_per_s, "cpu_flops_per_s");
  positive(d.cpu_memory_bytes_per_s, "cpu_memory_bytes_per_s");
  positive(d.ram_bytes, "ram_bytes");
  positive(d.disk_bytes_per_s, "disk_bytes_per_s");
  if (has_gpu(d)) {
    positive(d.gpu_flops_per_s, "gpu_flops_per_s");
    positive(d.gpu_memory_bytes_per_s, "gpu_memory_bytes_per_s");
    positive(d.vram_bytes, "vram_bytes");
  }
  BRIGADE_CHECK(d.swap_bytes >= 0 && d.link_seconds >= 0, Errc::InvalidArgument,
                "halda: device {} ({}): swap_bytes {} and link_seconds {} must not be negative", i,
                d.name, d.swap_bytes, d.link_seconds);
}

/// Seconds of one decoder layer on the device's CPU (alpha_m) and GPU: the roofline of a decode step.
double cpu_layer_s(const HaldaDevice& d, const HaldaModel& m) {
  return std::max(m.layer_flops / d.cpu_flops_per_s, m.layer_bytes / d.cpu_memory_bytes_per_s);
}
double gpu_layer_s(const HaldaDevice& d, const HaldaModel& m) {
  return std::max(m.layer_flops / d.gpu_flops_per_s, m.layer_bytes / d.gpu_memory_bytes_per_s);
}

/// What the head device holds besides its layers: one embedding row's worth and the output.
double head_bytes(const HaldaModel& m) { return m.input_bytes / m.vocab_size + m.output_bytes; }

/// The memory a device's case is judged against (prima.cpp's mem_budget).
double budget(const HaldaDevice& d) {
  if (d.gpu == "metal") return d.vram_bytes;
  return d.ram_bytes + (is_android(d) ? d.swap_bytes : 0.0);
}

struct Vectors {
  std::vector<double> a, b, z, zgpu;
  double xi_sum = 0, kappa = 0;
};

/// a_m, b_m, z_m, z_gpu_m and kappa of the cases (the integer program's data, prima.cpp §4).
Vectors vectors(const std::vector<HaldaDevice>& devs, const HaldaModel& m,
                const std::vector<int>& cases) {
  const std::size_t M = devs.size();
  const double bp = m.layer_bytes + m.kv_bytes;
  const double L = m.layers;
  Vectors v;
  v.a.assign(M, 0);
  v.b.assign(M, 0);
  v.z.assign(M, 0);
  v.zgpu.assign(M, 0);
  for (std::size_t i = 0; i < M; ++i) {
    const auto& d = devs[i];
    if (cases[i] == 0) continue;
    const double alpha = cpu_layer_s(d, m);
    const double beta = has_gpu(d) ? gpu_layer_s(d, m) - alpha : 0.0;
    const double disk = d.disk_bytes_per_s;
    switch (cases[i]) {
      case 1: v.a[i] = alpha + bp / disk; break;
      case 2: v.a[i] = alpha + m.layer_bytes / disk; v.b[i] = beta; break;
      case 3: v.a[i] = alpha + bp / disk; v.b[i] = has_gpu(d) ? beta - bp / disk : 0.0; break;
      default: v.a[i] = alpha; v.b[i] = beta; break;
    }
    v.xi_sum += d.link_seconds;
    const double cio = i == 0 ? head_bytes(m) : 0.0;
    const double z = (budget(d) - cio) / (L * bp);
    v.z[i] = cases[i] == 4 ? -z : z;
    if (has_gpu(d)) v.zgpu[i] = std::max(0.0, d.vram_bytes / (L * bp));
    if (cases[i] == 1 || cases[i] == 3)
      v.kappa -= (d.ram_bytes + (is_android(d) ? d.swap_bytes : 0.0)) / disk;
  }
  const auto& h = devs[0];
  v.kappa += std::max(m.output_flops / h.cpu_flops_per_s, m.output_bytes / h.cpu_memory_bytes_per_s);
  v.kappa += (m.input_bytes / m.vocab_size) / h.disk_bytes_per_s;
  if (cases[0] != 4) v.kappa += m.output_bytes / h.disk_bytes_per_s;
  return v;
}

struct Solution {
  bool ok = false;
  std::vector<int> w, n;
  std::vector<int> cases;  // the case assignment the program was solved for
  double objective = 0;
};

/// The integer program of one k over the devices with cases != 0, solved by CBC.
Solution solve_k(const std::vector<HaldaDevice>& devs, const HaldaModel& model,
                 const std::vector<int>& cases, const Vectors& v, int k) {
  std::vector<int> idx;  // devices in the ring
  for (std::size_t i = 0; i < devs.size(); ++i)
    if (cases[i] != 0) idx.push_back(static_cast<int>(i));
  const int M = static_cast<int>(idx.size());
  const int W = model.layers / k;
  const int cols = 2 * M, rows = 1 + 3 * M;
  // Column-wise matrix.
  std::vector<std::vector<std::pair<int, double>>> col(static_cast<std::size_t>(cols));
  std::vector<double> rlo(static_cast<std::size_t>(rows), -kInf),
      rhi(static_cast<std::size_t>(rows), kInf);
  rlo[0] = rhi[0] = W;  // sum w = W
  for (int j = 0; j < M; ++j) {
    const auto& d = devs[static_cast<std::size_t>(idx[static_cast<std::size_t>(j)])];
    const int c = cases[static_cast<std::size_t>(idx[static_cast<std::size_t>(j)])];
    const double z = v.z[static_cast<std::size_t>(idx[static_cast<std::size_t>(j)])];
    const double zg = v.zgpu[static_cast<std::size_t>(idx[static_cast<std::size_t>(j)])];
    auto& cw = col[static_cast<std::size_t>(j)];
    auto& cn = col[static_cast<std::size_t>(M + j)];
    cw.push_back({0, 1.0});
    // n_j - w_j <= 0
    cw.push_back({1 + j, -1.0});
    cn.push_back({1 + j, 1.0});
    rhi[static_cast<std::size_t>(1 + j)] = 0.0;
    // RAM row of the case: <= -W z
    const int r = 1 + M + j;
    if (c == 1 || c == 2) {
      cw.push_back({r, -1.0});
    } else if (c == 3) {
      cw.push_back({r, -1.0});
      if (has_gpu(d)) cn.push_back({r, 1.0});
    } else {
      cw.push_back({r, 1.0});
      if (!is_macos(d) && has_gpu(d)) cn.push_back({r, -1.0});
    }
    rhi[static_cast<std::size_t>(r)] = -W * z;
    // VRAM: n_j <= W z_gpu
    cn.push_back({1 + 2 * M + j, 1.0});
    rhi[static_cast<std::size_t>(1 + 2 * M + j)] = std::max(0.0, std::floor(W * zg + 1e-9));
  }
  std::vector<CoinBigIndex> start{0};
  std::vector<int> index;
  std::vector<double> value;
  for (const auto& c : col) {
    for (const auto& [row, val] : c) {
      index.push_back(row);
      value.push_back(val);
    }
    start.push_back(static_cast<CoinBigIndex>(index.size()));
  }
  std::vector<double> lo(static_cast<std::size_t>(cols), 0.0), hi(static_cast<std::size_t>(cols), W),
      obj(static_cast<std::size_t>(cols), 0.0);
  for (int j = 0; j < M; ++j) {
    lo[static_cast<std::size_t>(j)] = 1.0;
    obj[static_cast<std::size_t>(j)] = k * v.a[static_cast<std::size_t>(idx[static_cast<std::size_t>(j)])];
    obj[static_cast<std::size_t>(M + j)] = k * v.b[static_cast<std::size_t>(idx[static_cast<std::size_t>(j)])];
    if (!has_gpu(devs[static_cast<std::size_t>(idx[static_cast<std::size_t>(j)])]))
      hi[static_cast<std::size_t>(M + j)] = 0.0;
  }
  std::unique_ptr<Cbc_Model, void (*)(Cbc_Model*)> cbc(Cbc_newModel(), Cbc_deleteModel);
  Cbc_setLogLevel(cbc.get(), 0);
  Cbc_loadProblem(cbc.get(), cols, rows, start.data(), index.data(), value.data(), lo.data(),
                  hi.data(), obj.data(), rlo.data(), rhi.data());
  for (int j = 0; j < cols; ++j) Cbc_setInteger(cbc.get(), j);
  Cbc_setObjSense(cbc.get(), 1.0);  // minimise
  Cbc_solve(cbc.get());
  Solution s;
  if (!Cbc_isProvenOptimal(cbc.get())) return s;
  const double* x = Cbc_getColSolution(cbc.get());
  s.ok = true;
  s.w.assign(devs.size(), 0);
  s.n.assign(devs.size(), 0);
  for (int j = 0; j < M; ++j) {
    s.w[static_cast<std::size_t>(idx[static_cast<std::size_t>(j)])] =
        static_cast<int>(std::lround(x[j]));
    s.n[static_cast<std::size_t>(idx[static_cast<std::size_t>(j)])] =
        static_cast<int>(std::lround(x[M + j]));
  }
  s.objective = Cbc_getObjValue(cbc.get()) + k * v.xi_sum + v.kappa;
  return s;
}

std::string join(const std::vector<int>& v) {
  std::string s;
  for (const int x : v) s += fmt::format("{}{}", s.empty() ? "" : ",", x);
  return s;
}

/// One run of the case iteration over the devices `in` (the others have case 0 throughout).
/// `start`: empty for prima.cpp's start (cases from the proportional windows), else the case
/// assignment of the first iteration.
HaldaResult assign(const std::vector<HaldaDevice>& devs, const HaldaModel& model,
                   const std::vector<char>& in, const HaldaOptions& o,
                   const std::vector<int>& start = {}) {
  const std::size_t M = devs.size();
  const int L = model.layers;
  HaldaResult res;
  std::vector<int> w(M, 0), n(M, 0);
  // Windows in proportion to the memory budgets, each >= 1, the remainder on the largest (or
  // taken from the smallest) budget.
  double total = 0;
  for (std::size_t i = 0; i < M; ++i)
    if (in[i]) total += budget(devs[i]);
  for (std::size_t i = 0; i < M; ++i)
    if (in[i]) w[i] = static_cast<int>(std::lround(budget(devs[i]) / total * L));
  for (std::size_t i = 0; i < M; ++i) {
    if (!in[i] || w[i] > 0) continue;
    w[i] = 1;
    auto mx = std::max_element(w.begin(), w.end());
    if (*mx > 1) --*mx;
  }
  const int diff = L - std::accumulate(w.begin(), w.end(), 0);
  std::size_t pick = M;
  for (std::size_t i = 0; i < M; ++i) {
    if (!in[i]) continue;
    if (pick == M || (diff > 0 ? budget(devs[i]) > budget(devs[pick]) : budget(devs[i]) < budget(devs[pick])))
      pick = i;
  }
  w[pick] += diff;
  for (std::size_t i = 0; i < M; ++i)
    if (in[i] && has_gpu(devs[i])) n[i] = w[i];
  std::vector<int> ks;
  if (o.fixed_k > 0) {
    ks.push_back(o.fixed_k);
  } else {
    for (int k = 1; k <= std::max(1, L / 2); ++k)
      if (L % k == 0) ks.push_back(k);
  }
  std::vector<char> forced(M, 0);
  std::vector<int> cases, prev_cases;
  Solution final_sol, rollback, best_seen;  // best_seen: the lowest T of any iteration
  int final_k = 0, rollback_k = 0, best_seen_k = 0;
  for (;;) {
    const int W = std::accumulate(w.begin(), w.end(), 0);
    BRIGADE_CHECK(W >= 1 && L % W == 0, Errc::InvalidArgument,
                  "halda: the windows {} sum to {}, which does not divide the {} layers", join(w), W, L);
    const int cur_k = L / W;
    cases = prev_cases.empty() && !start.empty()
                ? start
                : halda_cases(devs, model, w, n, cur_k, o.min_disk_bytes_per_s);
    for (std::size_t i = 0; i < M; ++i) {
      if (!in[i]) cases[i] = 0;
      else if (forced[i]) cases[i] = 4;
    }
    if (cases == prev_cases) break;
    prev_cases = cases;
    ++res.iterations;
    const Vectors v = vectors(devs, model, cases);
    Solution best;
    int best_k = 0;
    for (const int k : ks) {
      Solution s = solve_k(devs, model, cases, v, k);
      s.cases = cases;
      res.log.push_back(s.ok ? fmt::format("cases {}: k = {}: T = {:.4f} s, w = {}, n = {}",
                                           join(cases), k, s.objective, join(s.w), join(s.n))
                             : fmt::format("cases {}: k = {}: infeasible", join(cases), k));
      if (s.ok && (!best.ok || s.objective < best.objective)) {
        best = s;
        best_k = k;
      }
    }
    if (!best.ok) {
      final_sol = rollback;
      final_k = rollback_k;
      if (final_sol.ok) {
        w = final_sol.w;
        n = final_sol.n;
      }
      break;
    }
    rollback = best;
    rollback_k = best_k;
    if (!best_seen.ok || best.objective < best_seen.objective) {
      best_seen = best;
      best_seen_k = best_k;
    }
    // Free VRAM on a device while another runs layers on its CPU: force the slowest disk not
    // yet in M4 into M4 and assign again (prima.cpp).
    bool weak = false, free_gpu = false, gpu_over = false, cpu_over = false;
    const int Wb = L / best_k;
    for (std::size_t i = 0; i < M; ++i) {
      if (!in[i]) continue;
      if (best.w[i] == 1 && best.n[i] == 0) weak = true;
      if (has_gpu(devs[i])) {
        if (best.n[i] < static_cast<int>(std::floor(Wb * v.zgpu[i] + 1e-9))) free_gpu = true;
        if (best.w[i] > best.n[i]) gpu_over = true;
      } else if (cases[i] != 4) {
        cpu_over = true;
      }
    }
    if (!weak && free_gpu && (gpu_over || cpu_over)) {
      std::size_t worst = M;
      for (std::size_t i = 0; i < M; ++i)
        if (in[i] && cases[i] != 4 &&
            (worst == M || devs[i].disk_bytes_per_s < devs[worst].disk_bytes_per_s))
          worst = i;
      if (worst != M) {
        forced[worst] = 1;
        res.log.push_back(fmt::format("device {} ({}) forced into M4", worst, devs[worst].name));
      }
      continue;
    }
    w = best.w;
    n = best.n;
    const bool same = final_sol.ok && final_sol.w == best.w && final_sol.n == best.n && final_k == best_k;
    final_sol = best;
    final_k = best_k;
    if (same) break;
  }
  if (!final_sol.ok && rollback.ok) {  // the last sets solved before the iteration stopped
    final_sol = rollback;
    final_k = rollback_k;
  }
  if (best_seen.ok && (!final_sol.ok || best_seen.objective < final_sol.objective)) {
    final_sol = best_seen;  // an earlier iteration's sets gave a lower T than the fixed point
    final_k = best_seen_k;
  }
  BRIGADE_CHECK(final_sol.ok, Errc::InvalidArgument,
                "halda: no assignment of the {} layers fits the devices' memory for any k in {}",
                L, join(ks));
  res.k = final_k;
  res.windows = final_sol.w;
  res.gpu_layers = final_sol.n;
  res.cases = final_sol.cases;
  res.tpot_seconds = halda_latency(devs, model, res.cases, res.windows, res.gpu_layers, res.k);
  return res;
}

}  // namespace

HaldaModel HaldaModel::of(const model::LlamaConfig& c, double bits_per_weight, int context) {
  BRIGADE_CHECK(bits_per_weight > 0 && context > 0, Errc::InvalidArgument,
                "HaldaModel::of: bits_per_weight = {} and context = {}, expected both > 0",
                bits_per_weight, context);
  const double d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  const double matrices = 2 * d * d + 2 * d * kv + 3 * d * h;
  HaldaModel m;
  m.layers = c.n_layers;
  m.layer_bytes = matrices * bits_per_weight / 8 + 2 * d * 4;
  m.kv_bytes = 2.0 * 2 * kv * context;  // keys and values, f16
  m.layer_flops = 2 * matrices + 4 * d * (context / 2.0);
  m.input_bytes = v * d * bits_per_weight / 8;
  m.output_bytes = v * d * bits_per_weight / 8 + d * 4;
  m.output_flops = 2 * v * d;
  m.vocab_size = c.vocab_size;
  return m;
}

std::vector<int> HaldaResult::kept() const {
  std::vector<int> out;
  for (std::size_t i = 0; i < windows.size(); ++i)
    if (windows[i] > 0) out.push_back(static_cast<int>(i));
  return out;
}

std::vector<int> halda_cases(const std::vector<HaldaDevice>& devs, const HaldaModel& m,
                             const std::vector<int>& w, const std::vector<int>& n, int k,
                             double min_disk) {
  BRIGADE_CHECK(w.size() == devs.size() && n.size() == devs.size(), Errc::InvalidArgument,
                "halda_cases: {} windows and {} GPU layer counts for {} devices", w.size(),
                n.size(), devs.size());
  const double bp = m.layer_bytes + m.kv_bytes;
  std::vector<int> out(devs.size(), 0);
  for (std::size_t i = 0; i < devs.size(); ++i) {
    if (w[i] == 0) continue;
    const auto& d = devs[i];
    const double l = static_cast<double>(w[i]) * k, lg = static_cast<double>(n[i]) * k;
    const double cio = i == 0 ? head_bytes(m) : 0.0;
    const double all = l * m.layer_bytes + cio + m.kv_bytes * l;
    if (d.disk_bytes_per_s < min_disk) out[i] = 4;
    else if (is_macos(d) && d.gpu != "metal" && all > d.ram_bytes) out[i] = 1;
    else if (d.gpu == "metal" && all > d.vram_bytes) out[i] = 2;
    else if (!is_macos(d) && (l - lg) * bp + cio > budget(d)) out[i] = 3;
    else out[i] = 4;
  }
  return out;
}

double halda_latency(const std::vector<HaldaDevice>& devs, const HaldaModel& m,
                     const std::vector<int>& cases, const std::vector<int>& w,
                     const std::vector<int>& n, int k) {
  BRIGADE_CHECK(cases.size() == devs.size() && w.size() == devs.size() && n.size() == devs.size(),
                Errc::InvalidArgument,
                "halda_latency: {} cases, {} windows, {} GPU layer counts for {} devices",
                cases.size(), w.size(), n.size(), devs.size());
  const Vectors v = vectors(devs, m, cases);
  double t = 0;
  for (std::size_t i = 0; i < devs.size(); ++i) t += v.a[i] * w[i] + v.b[i] * n[i];
  return k * t + k * v.xi_sum + v.kappa;
}

HaldaResult halda(const std::vector<HaldaDevice>& devices, const HaldaModel& model,
                  const HaldaOptions& o) {
  BRIGADE_CHECK(!devices.empty(), Errc::InvalidArgument, "halda: no devices");
  BRIGADE_CHECK(model.layers >= 1 && model.layer_bytes > 0 && model.vocab_size >= 1,
                Errc::InvalidArgument,
                "halda: a model of {} layers of {} bytes (vocabulary {}), expected >= 1 layer of "
                "> 0 bytes",
                model.layers, model.layer_bytes, model.vocab_size);
  BRIGADE_CHECK(o.fixed_k == 0 || (o.fixed_k > 0 && model.layers % o.fixed_k == 0),
                Errc::InvalidArgument, "halda: k = {} does not divide the model's {} layers",
                o.fixed_k, model.layers);
  for (std::size_t i = 0; i < devices.size(); ++i) check_device(devices[i], i);
  std::vector<char> in(devices.size(), 1);
  int iterations = 0;
  std::vector<std::string> log;
  for (;;) {
    // prima.cpp's start, then (all_case_starts) one start from every case assignment of the
    // devices in the ring: each device overflowing its memory (its M1, M2 or M3) or not (M4),
    // M4 only for a disk below min_disk_bytes_per_s. The best result wins.
    std::optional<HaldaResult> best;
    const auto consider = [&](const std::vector<int>& start) {
      try {
        HaldaResult r = assign(devices, model, in, o, start);
        iterations += r.iterations;
        log.insert(log.end(), r.log.begin(), r.log.end());
        if (!best || r.tpot_seconds < best->tpot_seconds - 1e-12 * std::abs(best->tpot_seconds))
          best = std::move(r);
      } catch (const Error&) {
        log.push_back(fmt::format("start {}: no feasible assignment", join(start)));
      }
    };
    consider({});
    if (o.all_case_starts) {
      std::vector<std::size_t> free;
      std::vector<int> start(devices.size(), 0);
      for (std::size_t i = 0; i < devices.size(); ++i) {
        if (!in[i]) continue;
        const auto& d = devices[i];
        start[i] = 4;
        if (d.disk_bytes_per_s >= o.min_disk_bytes_per_s) free.push_back(i);
      }
      BRIGADE_CHECK(free.size() <= 16, Errc::InvalidArgument,
                    "halda: {} devices: all_case_starts tries 2^{} case assignments; turn it off",
                    free.size(), free.size());
      for (std::uint32_t mask = 0; mask < (1u << free.size()); ++mask) {
        for (std::size_t j = 0; j < free.size(); ++j) {
          const auto& d = devices[free[j]];
          const int over = is_macos(d) ? (d.gpu == "metal" ? 2 : 1) : 3;
          start[free[j]] = (mask >> j) & 1u ? over : 4;
        }
        consider(start);
      }
    }
    BRIGADE_CHECK(best.has_value(), Errc::InvalidArgument,
                  "halda: no assignment of the {} layers fits the devices' memory for any k",
                  model.layers);
    HaldaResult r = std::move(*best);
    bool removed = false;
    if (o.remove_devices)
      for (std::size_t i = 1; i < devices.size(); ++i)
        if (in[i] && r.windows[i] <= 1) {
          in[i] = 0;
          removed = true;
          log.push_back(fmt::format("device {} ({}) removed: w = {}, n = {}", i, devices[i].name,
                                    r.windows[i], r.gpu_layers[i]));
        }
    if (!removed) {
      r.iterations = iterations;
      r.log = std::move(log);
      return r;
    }
  }
}

HaldaResult halda_even_split(const std::vector<HaldaDevice>& devices, const HaldaModel& model) {
  BRIGADE_CHECK(!devices.empty() && static_cast<int>(devices.size()) <= model.layers,
                Errc::InvalidArgument, "halda_even_split: {} devices for {} layers",
                devices.size(), model.layers);
  for (std::size_t i = 0; i < devices.size(); ++i) check_device(devices[i], i);
  const int M = static_cast<int>(devices.size());
  const double bp = model.layer_bytes + model.kv_bytes;
  HaldaResult r;
  r.k = 1;
  for (int i = 0; i < M; ++i) {
    const int w = model.layers / M + (i < model.layers % M);
    const auto& d = devices[static_cast<std::size_t>(i)];
    const int n = has_gpu(d) ? std::min(w, static_cast<int>(std::floor(d.vram_bytes / bp))) : 0;
    r.windows.push_back(w);
    r.gpu_layers.push_back(n);
  }
  r.cases = halda_cases(devices, model, r.windows, r.gpu_layers, 1);
  r.tpot_seconds = halda_latency(devices, model, r.cases, r.windows, r.gpu_layers, 1);
  return r;
}

std::vector<HaldaMemory> halda_memory(const std::vector<HaldaDevice>& devices,
                                      const HaldaModel& model, const HaldaResult& r) {
  const double bp = model.layer_bytes + model.kv_bytes;
  std::vector<HaldaMemory> out(devices.size());
  for (std::size_t i = 0; i < devices.size() && i < r.windows.size(); ++i) {
    if (r.windows[i] == 0) continue;
    const auto& d = devices[i];
    const double cpu_layers = static_cast<double>(r.windows[i] - r.gpu_layers[i]) * r.k;
    const double want = cpu_layers * bp + (i == 0 ? head_bytes(model) : 0.0);
    const double room = d.gpu == "metal" ? d.vram_bytes : budget(d);
    out[i].vram_bytes = static_cast<double>(r.gpu_layers[i]) * r.k * bp;
    out[i].ram_bytes = std::min(want, room);
    out[i].disk_bytes_per_token = r.cases[i] == 4 ? 0.0 : std::max(0.0, want - room);
  }
  return out;
}

std::vector<HaldaDevice> load_halda_devices(const std::filesystem::path& path) {
  std::ifstream in(path);
  BRIGADE_CHECK(in.good(), Errc::BadFile, "{}: cannot read the devices file", path.string());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    ::brigade::detail::fail(Errc::BadFile, "{}: not JSON ({})", path.string(), e.what());
  }
  const auto field = [&](const nlohmann::json& o, const char* key, std::size_t i) -> const nlohmann::json& {
    BRIGADE_CHECK(o.contains(key), Errc::BadFile, "{}: device {} has no field '{}'", path.string(), i, key);
    return o.at(key);
  };
  BRIGADE_CHECK(j.is_object() && j.value("schema", "") == "brigade.halda_devices/1", Errc::BadFile,
                "{}: schema is not brigade.halda_devices/1", path.string());
  BRIGADE_CHECK(j.contains("devices") && j["devices"].is_array() && !j["devices"].empty(),
                Errc::BadFile, "{}: 'devices' is not a non-empty array", path.string());
  std::vector<HaldaDevice> out;
  for (std::size_t i = 0; i < j["devices"].size(); ++i) {
    const auto& o = j["devices"][i];
    const auto num = [&](const char* key, bool required) -> double {
      if (!required && !o.contains(key)) return 0.0;
      const auto& v = field(o, key, i);
      BRIGADE_CHECK(v.is_number(), Errc::BadFile, "{}: device {} field '{}' is not a number",
                    path.string(), i, key);
      return v.get<double>();
    };
    const auto str = [&](const char* key) -> std::string {
      const auto& v = field(o, key, i);
      BRIGADE_CHECK(v.is_string(), Errc::BadFile, "{}: device {} field '{}' is not a string",
                    path.string(), i, key);
      return v.get<std::string>();
    };
    HaldaDevice d;
    d.name = str("name");
    d.os = str("os");
    d.gpu = o.contains("gpu") ? str("gpu") : "none";
    d.cpu_flops_per_s = num("cpu_flops_per_s", true);
    d.cpu_memory_bytes_per_s = num("cpu_memory_bytes_per_s", true);
    d.ram_bytes = num("ram_bytes", true);
    d.disk_bytes_per_s = num("disk_bytes_per_s", true);
    const bool gpu = d.gpu != "none";
    d.gpu_flops_per_s = num("gpu_flops_per_s", gpu);
    d.gpu_memory_bytes_per_s = num("gpu_memory_bytes_per_s", gpu);
    d.vram_bytes = num("vram_bytes", gpu);
    d.swap_bytes = num("swap_bytes", false);
    d.link_seconds = num("link_seconds", false);
    try {
      check_device(d, i);
    } catch (const Error& e) {
      ::brigade::detail::fail(Errc::BadFile, "{}: {}", path.string(), e.what());
    }
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace v0
}  // namespace brigade::partition
