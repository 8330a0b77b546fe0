// `brigade plan --halda DEVICES.json --model FILE|NAME`: prima.cpp's Halda assignment of ring
// windows and GPU layers to home devices (partition/halda.hpp), beside the even split and Halda
// without device removal.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace brigade::cli {

/// The options of the Halda planning mode.
struct HaldaPlanArgs {
  std::string devices;       ///< --halda: the devices file (brigade.halda_devices/1)
  std::string model;         ///< --model: a named size or a model file
  double weight_bits = 0;    ///< --weight-bits: bits per weight; 0 = the file's, or 4.5 (Q4_K)
  int context = 4096;        ///< --context: KV positions per layer (prima.cpp's n_ctx)
  int rounds = 0;            ///< --ring: only this k; 0 = every k dividing the layers
  bool no_removal = false;   ///< --no-device-removal
  std::string json;          ///< --json: the assignment and the comparison as JSON
};

/// Adds --halda, --weight-bits, --context, --ring, --no-device-removal and --json to `sub`
/// (the `plan` subcommand; --model is the plan subcommand's own).
void add_halda_plan_options(CLI::App& sub, HaldaPlanArgs& a);

/// Runs Halda and prints, per device, its case, w_m, n_m, layers, RAM, VRAM and disk bytes
/// per token, the predicted TPOT, and the even split's and no-removal Halda's TPOT.
/// @return 0
/// @throws brigade::Error for an unreadable devices file, an unknown model, or no assignment
int run_halda_plan(const HaldaPlanArgs& a);

}  // namespace brigade::cli
