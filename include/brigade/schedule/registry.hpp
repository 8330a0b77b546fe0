// The name-to-generator table the CLI (and anything else choosing a schedule by name) uses:
// the built-in generators and the ones users register at run time.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/core/registry.hpp"
#include "brigade/schedule/adaptive.hpp"
#include "brigade/schedule/generators.hpp"

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::schedule {
inline namespace v0 {

/// A generator: returns a compute-only Schedule for the given parameters.
using GeneratorFn = Schedule (*)(const Params&);

/// One entry of the generator table.
struct GeneratorInfo {
  std::string_view name;     ///< the CLI name, e.g. "1f1b"
  std::string_view summary;  ///< one line: what it does and where it comes from
  GeneratorFn make;          ///< the generator
  bool supports_virtual;     ///< whether Params::virtual_stages may exceed 1
  /// The only Params::virtual_stages the generator accepts (2 for the V shapes, whose two
  /// chunks per rank are the shape), or 0 when any V it supports is accepted.
  int required_virtual = 0;
};

namespace detail {

/// The generator table: the built-in generators, then those registered at run time.
inline Registry<GeneratorInfo>& generator_table() {
  static Registry<GeneratorInfo> table(
      "schedule",
      {
          {"gpipe", "all forwards, then all backwards (Huang et al. 2019)", &gpipe, false},
          {"1f1b", "one forward one backward, PipeDream-Flush (Narayanan et al. 2021)",
           &one_f_one_b, false},
          {"interleaved-1f1b",
           "V model chunks per rank in Megatron's order (Narayanan et al. 2021, PTD-P 2.2)",
           &interleaved_1f1b, true},
          {"zb-h1", "zero bubble H1: backward split into BI and BW (Qi et al. 2023, section 3)",
           &zero_bubble_h1, false},
          {"zb-v",
           "zero bubble V: two chunks per rank in a V, BI/BW split (Qi et al. 2023, section 6)",
           &zero_bubble_v, true, 2},
          {"dualpipe-v",
           "DualPipeV: DeepSeek-V3's DualPipe cut in half, overlapped F & B pairs "
           "(deepseek-ai/DualPipe)",
           &dualpipe_v, true, 2},
          {"adaptive",
           "DynaPipe's memory-aware adaptive order for unequal micro-batches (Jiang et al. 2024, "
           "section 5)",
           &adaptive, false},
          {"inference",
           "prefill + decode rounds of M sequence groups; the sampled token returns to stage 0",
           &inference, true},
      });
  return table;
}

}  // namespace detail

/// Every generator: the built-in ones in the order docs/schedules.md presents them (gpipe, 1f1b,
/// interleaved-1f1b, zb-h1, zb-v, dualpipe-v, adaptive, inference), then those added by
/// register_generator() in registration order.
inline std::span<const GeneratorInfo> generators() noexcept {
  return detail::generator_table().entries();
}

/// Adds a user generator to the table at run time, so engines (TrainingConfig::schedule), the
/// CLI and generate() find it by name like a built-in one. The name and summary are copied.
/// Register before lookups run on other threads (lookups do not lock).
/// @param info the entry; `make` must return a compute-only Schedule (lower() adds messages)
/// @throws brigade::Error{InvalidArgument} for an empty name, a name already taken, a null
///         `make`, or more than 256 generators in all
inline void register_generator(const GeneratorInfo& info) {
  detail::generator_table().add(info, info.make != nullptr);
}

/// The generator called `name`.
/// @throws brigade::Error{InvalidArgument} for an unknown name, listing the known ones
inline const GeneratorInfo& find_generator(std::string_view name) {
  return detail::generator_table().find(name);
}

/// The V the generator called `name` runs with when none is asked for: its required_virtual
/// (2 for zb-v and dualpipe-v), else 1. The CLI's default for `--virtual`.
/// @throws brigade::Error{InvalidArgument} for an unknown name, listing the known ones
inline int default_virtual_stages(std::string_view name) {
  const auto& g = find_generator(name);
  return g.required_virtual > 0 ? g.required_virtual : 1;
}

/// Runs the generator called `name`: `find_generator(name).make(params)`.
/// @throws brigade::Error{InvalidArgument} for an unknown name or parameters the generator
///         rejects
inline Schedule generate(std::string_view name, const Params& params) {
  return find_generator(name).make(params);
}

}  // namespace v0
}  // namespace brigade::schedule
