// SVG plot of the TP x PP planner's plans: latency against throughput on log-log axes, one
// colour per grid, the Pareto front as a line and the SLA's pick circled. docs/tp_pp.md's
// pictures come from here (`brigade plan --svg FILE`).
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/io/trace.hpp"
#include "brigade/plan/tp_planner.hpp"
#include "brigade/sim/svg.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace brigade::plan {
inline namespace v0 {

/// An SVG scatter plot (width 760 px, height 480 px) of the fitting `plans`: x = latency_s
/// (a request's end-to-end seconds), y = tokens_per_s, both logarithmic with a tick per decade
/// (and at 2 and 5), one colour per TP x PP grid (legend at the right), the points of `front`
/// joined by a line, and `pick` (if any) circled in red. `title` is drawn at the top.
/// @throws brigade::Error{InvalidArgument} if no plan fits (nothing to plot)
inline std::string render_front_svg(const std::vector<TpPpPlan>& plans,
                                    const std::vector<TpPpPlan>& front,
                                    const std::optional<TpPpPlan>& pick, const std::string& title) {
  std::vector<const TpPpPlan*> fit;
  for (const auto& p : plans)
    if (p.fits) fit.push_back(&p);
  BRIGADE_CHECK(!fit.empty(), Errc::InvalidArgument, "front plot: no plan fits in memory");
  double x0 = 1e300, x1 = 0.0, y0 = 1e300, y1 = 0.0;
  for (const auto* p : fit) {
    x0 = std::min(x0, p->latency_s);
    x1 = std::max(x1, p->latency_s);
    y0 = std::min(y0, p->tokens_per_s);
    y1 = std::max(y1, p->tokens_per_s);
  }
  const double lx0 = std::floor(std::log10(x0)), lx1 = std::max(lx0 + 1, std::ceil(std::log10(x1)));
  const double ly0 = std::floor(std::log10(y0)), ly1 = std::max(ly0 + 1, std::ceil(std::log10(y1)));
  constexpr double W = 760, H = 480, L = 70, R = 600, T = 40, B = 420;
  auto px = [&](double x) { return L + (std::log10(x) - lx0) / (lx1 - lx0) * (R - L); };
  auto py = [&](double y) { return B - (std::log10(y) - ly0) / (ly1 - ly0) * (B - T); };
  std::vector<std::pair<int, int>> grids;  // (tp, pp) in first-seen order
  for (const auto* p : fit)
    if (std::find(grids.begin(), grids.end(), std::pair{p->grid.tp, p->grid.pp}) == grids.end())
      grids.emplace_back(p->grid.tp, p->grid.pp);
  static constexpr std::array<const char*, 10> kColors = {
      "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
      "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
  auto color = [&](const TpPpPlan& p) {
    const auto it = std::find(grids.begin(), grids.end(), std::pair{p.grid.tp, p.grid.pp});
    return kColors[static_cast<std::size_t>(it - grids.begin()) % kColors.size()];
  };
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} "
      "{1}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{0}\" height=\"{1}\" "
      "fill=\"white\"/>\n<text x=\"{2}\" y=\"22\" font-size=\"14\">{3}</text>\n",
      W, H, L, sim::detail::xml_escape(title));
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" "
                   "stroke=\"#888\"/>\n", L, T, R - L, B - T);
  for (double d = lx0; d <= lx1; ++d)
    for (double m : {1.0, 2.0, 5.0}) {
      const double v = m * std::pow(10.0, d);
      if (std::log10(v) > lx1 + 1e-9) break;
      const double x = px(v);
      s += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#eee\"/>"
                       "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4:g}</text>\n",
                       x, T, B, B + 16, v);
    }
  for (double d = ly0; d <= ly1; ++d)
    for (double m : {1.0, 2.0, 5.0}) {
      const double v = m * std::pow(10.0, d);
      if (std::log10(v) > ly1 + 1e-9) break;
      const double y = py(v);
      s += fmt::format("<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#eee\"/>"
                       "<text x=\"{3}\" y=\"{4:.1f}\" text-anchor=\"end\">{5:g}</text>\n",
                       L, y, R, L - 6, y + 4, v);
    }
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">request latency, s (TTFT + "
                   "(output - 1) x TPOT)</text>\n", (L + R) / 2, B + 36);
  s += fmt::format("<text x=\"16\" y=\"{0}\" transform=\"rotate(-90 16 {0})\" "
                   "text-anchor=\"middle\">generated tokens / s</text>\n", (T + B) / 2);
  std::string line;
  for (const auto& p : front)
    line += fmt::format("{}{:.1f},{:.1f}", line.empty() ? "" : " ", px(p.latency_s),
                        py(p.tokens_per_s));
  s += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"#333\" stroke-width=\"1.5\"/>\n",
                   line);
  for (const auto* p : fit)
    s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"{}\"><title>{}: "
                     "{:.3g} s, {:.4g} tokens/s</title></circle>\n",
                     px(p->latency_s), py(p->tokens_per_s), color(*p), p->describe(),
                     p->latency_s, p->tokens_per_s);
  if (pick)
    s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"9\" fill=\"none\" stroke=\"#d00\" "
                     "stroke-width=\"2\"/>\n", px(pick->latency_s), py(pick->tokens_per_s));
  for (std::size_t i = 0; i < grids.size(); ++i) {
    const double y = T + 10 + 20.0 * static_cast<double>(i);
    s += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"5\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">"
                     "TP{} x PP{}</text>\n",
                     R + 20, y, kColors[i % kColors.size()], R + 32, y + 4, grids[i].first,
                     grids[i].second);
  }
  const double ly = T + 20.0 + 20.0 * static_cast<double>(grids.size());
  s += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#333\" stroke-width="
                   "\"1.5\"/><text x=\"{}\" y=\"{}\">Pareto front</text>\n",
                   R + 12, ly, R + 28, ly, R + 32, ly + 4);
  if (pick)
    s += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"7\" fill=\"none\" stroke=\"#d00\" "
                     "stroke-width=\"2\"/><text x=\"{}\" y=\"{}\">SLA pick</text>\n",
                     R + 20, ly + 20, R + 32, ly + 24);
  s += "</svg>\n";
  return s;
}

/// Writes render_front_svg() to `path` atomically (io::write_file_atomic).
/// @throws brigade::Error{BadFile} if it cannot be written; as render_front_svg()
inline void write_front_svg(const std::filesystem::path& path, const std::vector<TpPpPlan>& plans,
                            const std::vector<TpPpPlan>& front,
                            const std::optional<TpPpPlan>& pick, const std::string& title) {
  io::write_file_atomic(path, render_front_svg(plans, front, pick, title));
}

}  // namespace v0
}  // namespace brigade::plan
