// SVG rendering of a Timeline: ranks as rows, one box per compute interval, colored by op,
// micro-batch numbers in the boxes. The pictures in docs/schedules.md come from here.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/core/timeline.hpp"
#include "brigade/io/trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <string>
#include <string_view>

namespace brigade::sim {
inline namespace v0 {

/// Options of render_svg().
struct SvgOptions {
  std::string title;                ///< drawn above the rows when non-empty
  int width = 1000;                 ///< picture width in px (>= 200)
  int row_height = 26;              ///< px per rank row (>= 8)
  bool show_communication = false;  ///< draw SEND/RECV intervals as thin grey bars under rows
  bool seconds = true;  ///< axis in seconds with SI prefixes; false: plain time units (unit costs)
};

namespace detail {

inline std::string xml_escape(std::string_view s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += ch;
    }
  }
  return out;
}

/// Fill color of an op (Tableau 10): F blue, B and BI green, BW orange, RECOMPUTE purple,
/// SAMPLE red, OPT grey, PREFETCH teal, RELEASE yellow, MIGRATE brown, communication light grey.
inline std::string_view op_color(Op op) noexcept {
  switch (op) {
    case Op::F:
      return "#4e79a7";
    case Op::B:
      return "#59a14f";
    case Op::BI:
      return "#59a14f";
    case Op::BW:
      return "#f28e2b";
    case Op::Recompute:
      return "#b07aa1";
    case Op::Sample:
      return "#e15759";
    case Op::Opt:
      return "#555555";
    case Op::Prefetch:
      return "#76b7b2";
    case Op::Release:
      return "#edc948";
    case Op::Migrate:
    case Op::MigrateRecv:
      return "#9c755f";
    default:
      return "#bab0ac";
  }
}

/// `hex` mixed with white by `amount` in [0, 1].
inline std::string lighten(std::string_view hex, double amount) {
  auto channel = [&](std::size_t at) {
    const int v = std::stoi(std::string(hex.substr(at, 2)), nullptr, 16);
    return static_cast<int>(std::lround(v + (255 - v) * amount));
  };
  return fmt::format("#{:02x}{:02x}{:02x}", channel(1), channel(3), channel(5));
}

inline std::string time_label(double t, double span, bool seconds) {
  if (!seconds) return fmt::format("{:g}", t);
  if (span < 1e-3) return fmt::format("{:g} us", t * 1e6);
  if (span < 1.0) return fmt::format("{:g} ms", t * 1e3);
  return fmt::format("{:g} s", t);
}

}  // namespace detail

/// Renders `tl` as a standalone SVG document: one row per rank ("rank r" on the left), time to
/// the right with a tick axis, a box per compute interval colored by op (F blue, B/BI green,
/// BW orange, RECOMPUTE purple, SAMPLE red, OPT grey) holding its micro-batch number when the
/// box is wide enough. Later model chunks of interleaved schedules (virtual stage v on rank
/// v mod P, chunk v div P) are drawn lighter. Inference rounds after the prefill are drawn
/// with a dashed outline. Weight loads and releases (PREFETCH, RELEASE, MIGRATE) overlap
/// compute, so they are drawn as a thin strip over the top of the row (at least 1.5 px wide,
/// so an instantaneous RELEASE shows as a tick). A legend lists the ops present.
/// @throws brigade::Error{InvalidArgument} for width < 200 or row_height < 8
inline std::string render_svg(const Timeline& tl, const SvgOptions& opt = {}) {
  BRIGADE_CHECK(opt.width >= 200 && opt.row_height >= 8, Errc::InvalidArgument,
                "render_svg: width {} px and row height {} px, expected >= 200 and >= 8", opt.width,
                opt.row_height);
  const int P = tl.num_ranks();
  const double left = 64, right = 16, top = opt.title.empty() ? 12 : 36;
  const double row = opt.row_height, gap = 4;
  const double rows_h = P * (row + gap);
  const double axis_h = 30, legend_h = 26;
  const double height = top + rows_h + axis_h + legend_h;
  const double t0 = tl.begin();
  const double span = tl.makespan() > 0 ? tl.makespan() : 1.0;
  const double plot_w = opt.width - left - right;
  auto x_of = [&](double t) { return left + (t - t0) / span * plot_w; };
  int chunks = 1;
  for (const auto& iv : tl.intervals()) chunks = std::max(chunks, iv.virtual_stage / P + 1);

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{:.0f}\" viewBox=\"0 0 {} "
      "{:.0f}\" font-family=\"Helvetica, Arial, sans-serif\">\n",
      opt.width, height, opt.width, height);
  svg += fmt::format("<rect width=\"{}\" height=\"{:.0f}\" fill=\"white\"/>\n", opt.width, height);
  if (!opt.title.empty())
    svg += fmt::format("<text x=\"{}\" y=\"22\" font-size=\"14\" font-weight=\"bold\">{}</text>\n",
                       left, detail::xml_escape(opt.title));
  for (int r = 0; r < P; ++r) {
    const double y = top + r * (row + gap);
    svg += fmt::format(
        "<rect x=\"{}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{}\" fill=\"#f4f4f4\"/>\n"
        "<text x=\"{}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\">rank {}</text>\n",
        left, y, plot_w, row, left - 6, y + row / 2 + 4, r);
  }
  std::array<bool, kNumOps> present{};
  const double font = std::min(11.0, row * 0.5);
  std::string memory_strips;  // drawn last, over the compute boxes
  for (const auto& iv : tl.intervals()) {
    const double y = top + iv.rank * (row + gap);
    const double x = x_of(iv.start), w = std::max(0.0, x_of(iv.end) - x);
    if (is_memory_op(iv.op)) {
      present[static_cast<std::size_t>(iv.op)] = true;
      memory_strips += fmt::format(
          "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\" fill=\"{}\"><title>{} "
          "vs{}{} [{:g}, {:g}]</title></rect>\n",
          x, y, std::max(1.5, w), std::max(3.0, row / 5.0), detail::op_color(iv.op),
          to_string(iv.op), iv.virtual_stage,
          iv.chunk ? fmt::format(" c{}", iv.chunk) : std::string(), iv.start, iv.end);
      continue;
    }
    if (is_communication(iv.op)) {
      if (!opt.show_communication) continue;
      present[static_cast<std::size_t>(iv.op)] = true;
      svg += fmt::format(
          "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"3\" fill=\"{}\"><title>{} "
          "{}</title></rect>\n",
          x, y + row + 0.5, w, detail::op_color(iv.op), to_string(iv.op), iv.microbatch);
      continue;
    }
    present[static_cast<std::size_t>(iv.op)] = true;
    const int chunk = iv.virtual_stage / P;
    const std::string fill = chunks > 1
                                 ? detail::lighten(detail::op_color(iv.op), 0.55 * chunk / chunks)
                                 : std::string(detail::op_color(iv.op));
    svg += fmt::format(
        "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" fill=\"{}\" "
        "stroke=\"white\" stroke-width=\"0.6\"{}><title>{} vs{} mb{}{} [{:g}, "
        "{:g}]</title></rect>\n",
        x, y, w, row, fill, iv.chunk > 0 && !iv.label.empty() ? " stroke-dasharray=\"2,1\"" : "",
        to_string(iv.op), iv.virtual_stage, iv.microbatch,
        iv.chunk ? fmt::format(" c{}", iv.chunk) : std::string(), iv.start, iv.end);
    const std::string text = std::to_string(iv.microbatch);
    if (w >= 3.0 + 0.62 * font * static_cast<double>(text.size()))
      svg += fmt::format(
          "<text x=\"{:.2f}\" y=\"{:.1f}\" font-size=\"{:.1f}\" fill=\"white\" "
          "text-anchor=\"middle\">{}</text>\n",
          x + w / 2, y + row / 2 + font * 0.35, font, text);
  }
  svg += memory_strips;
  // Time axis with 1-2-5 ticks.
  const double axis_y = top + rows_h + 4;
  svg +=
      fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#333\"/>\n",
                  left, axis_y, left + plot_w, axis_y);
  const double raw = span / 8.0;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double f : {1.0, 2.0, 5.0, 10.0})
    if (f * mag >= raw) {
      step = f * mag;
      break;
    }
  for (int k = 0; k * step <= span * (1 + 1e-9); ++k) {
    const double t = k * step;
    const double x = left + t / span * plot_w;
    svg += fmt::format(
        "<line x1=\"{:.2f}\" y1=\"{:.1f}\" x2=\"{:.2f}\" y2=\"{:.1f}\" stroke=\"#333\"/>\n"
        "<text x=\"{:.2f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"middle\">{}</text>\n",
        x, axis_y, x, axis_y + 4, x, axis_y + 15, detail::time_label(t, span, opt.seconds));
  }
  // Legend.
  double lx = left;
  const double ly = top + rows_h + axis_h;
  for (int k = 0; k < kNumOps; ++k) {
    if (!present[static_cast<std::size_t>(k)]) continue;
    const Op op = static_cast<Op>(k);
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"12\" height=\"12\" fill=\"{}\"/>\n"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\">{}</text>\n",
        lx, ly, detail::op_color(op), lx + 16, ly + 10, to_string(op));
    lx += 28 + 7.0 * static_cast<double>(to_string(op).size());
  }
  svg += "</svg>\n";
  return svg;
}

/// Writes render_svg(tl, opt) to `path` atomically (io::write_file_atomic).
/// @throws brigade::Error{BadFile} if the file cannot be written; as render_svg()
inline void write_svg(const std::filesystem::path& path, const Timeline& tl,
                      const SvgOptions& opt = {}) {
  io::write_file_atomic(path, render_svg(tl, opt));
}

}  // namespace v0
}  // namespace brigade::sim
