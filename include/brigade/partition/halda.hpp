// Halda: prima.cpp's heterogeneity-aware assignment of ring windows and GPU layers to home
// devices (Li et al. 2025, "PRIMA.CPP: Speeding Up 70B-Scale LLM Inference on Low-Resource
// Everyday Home Clusters", §4: the latency model, the device cases M1-M4, the integer program
// per k, the iteration of the case assignment and the removal of devices that slow the ring).
// The integer programs are solved by COIN-OR CBC (Debian's coinor-libcbc-dev); brigade::halda.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"

#include <filesystem>
#include <string>
#include <vector>

namespace brigade::partition {
inline namespace v0 {

/// One device of a home cluster, what prima.cpp's profiler measures (rates in units per second,
/// sizes in bytes). Rates are those a decode step sees: per-layer time is the roofline
/// max(FLOPs / flops_per_s, bytes / memory_bytes_per_s).
struct HaldaDevice {
  std::string name;
  std::string os = "linux";       ///< "macos", "linux" or "android" (selects the case M1-M3)
  std::string gpu = "none";       ///< "none", "cuda" or "metal" (macOS unified memory)
  double cpu_flops_per_s = 0;     ///< CPU FLOP/s on the model's weights (> 0)
  double cpu_memory_bytes_per_s = 0;  ///< CPU read rate from RAM (> 0)
  double gpu_flops_per_s = 0;     ///< GPU FLOP/s (> 0 with a GPU)
  double gpu_memory_bytes_per_s = 0;  ///< GPU read rate from VRAM (> 0 with a GPU)
  double ram_bytes = 0;           ///< RAM available to the model (> 0)
  double vram_bytes = 0;          ///< GPU memory available (Metal: what the GPU may map of RAM)
  double swap_bytes = 0;          ///< Android: memory that can be swapped out for the model
  double disk_bytes_per_s = 0;    ///< read rate of the disk holding the model file (> 0)
  double link_seconds = 0;        ///< xi_m: the hop to the next device, per round (seconds)
};

/// What Halda needs of the model: the decoder layers and their bytes and FLOPs per token.
struct HaldaModel {
  int layers = 0;              ///< L, decoder layers
  double layer_bytes = 0;      ///< b: one decoder layer's weights as stored (bytes)
  double kv_bytes = 0;         ///< one layer's KV cache at the context (bytes): b' = b + kv_bytes
  double layer_flops = 0;      ///< one layer's FLOPs per decoded token
  double input_bytes = 0;      ///< b_i: the embedding table (bytes; one row read per token)
  double output_bytes = 0;     ///< b_o: final norm and LM head (bytes)
  double output_flops = 0;     ///< the LM head's FLOPs per token
  int vocab_size = 1;

  /// The model of a Llama config: matrices at `bits_per_weight` (32 f32, 16 f16, 8.5 Q8_0,
  /// 4.5 Q4_K), norm gains f32, a KV cache of `context` positions in f16 (prima.cpp's n_ctx),
  /// attention FLOPs at half the context.
  /// @throws brigade::Error{InvalidArgument} if bits_per_weight or context is not positive
  static HaldaModel of(const model::LlamaConfig& c, double bits_per_weight, int context);
};

/// The assignment of one ring: window sizes w_m and GPU layers n_m per device (in device order;
/// 0 and 0 for a device removed), k rounds (L = k x sum w), the case of each device and the
/// predicted time per output token.
struct HaldaResult {
  int k = 0;
  std::vector<int> windows;       ///< w_m (decoder layers per round); 0 = device removed
  std::vector<int> gpu_layers;    ///< n_m <= w_m
  std::vector<int> cases;         ///< 1..4 (M1..M4); 0 = removed
  double tpot_seconds = 0;        ///< the latency model's T at the assignment
  int iterations = 0;             ///< case-assignment iterations (over all removal rounds)
  std::vector<std::string> log;   ///< one line per step (k tried, cases, removals)
  /// Devices kept (w_m > 0), in order.
  [[nodiscard]] std::vector<int> kept() const;
};

/// Options of halda().
struct HaldaOptions {
  bool remove_devices = true;       ///< drop devices left with one layer and no GPU layer, re-solve
  double min_disk_bytes_per_s = 1e8;  ///< slower disks put the device in M4 (prima.cpp: 100 MB/s)
  int fixed_k = 0;                  ///< > 0: only this k (must divide L)
  /// Besides prima.cpp's start (cases from windows proportional to memory), start the case
  /// iteration from every case assignment (each device overflowing its memory or not: 2^M
  /// starts, M <= 16) and keep the best: the result is then the latency model's optimum over
  /// all assignments. False: prima.cpp's single start, which can stop at a worse fixed point.
  bool all_case_starts = true;
};

/// The latency model (§4, eq. for T): for devices in the cases `cases`,
/// T = k x sum_m (a_m w_m + b_m n_m + xi_m) + kappa, with a_m = alpha_m plus the disk time of
/// a layer (b'/s_disk in M1 and M3, b/s_disk in M2), b_m = beta_m (minus b'/s_disk in M3),
/// alpha_m the CPU time of a layer, beta_m the GPU's minus the CPU's, and kappa the head
/// device's input row, LM head and, in M1/M3, minus what its RAM holds read at disk speed.
/// @param cases per device 1..4, or 0 for a device not in the ring
/// @throws brigade::Error{InvalidArgument} on sizes that do not match
double halda_latency(const std::vector<HaldaDevice>& devices, const HaldaModel& model,
                     const std::vector<int>& cases, const std::vector<int>& windows,
                     const std::vector<int>& gpu_layers, int k);

/// The case (1..4) each device is in for an assignment: M4 when what it holds fits its memory
/// or its disk is slower than `min_disk_bytes_per_s`; else M1 (macOS, no Metal), M2 (macOS,
/// Metal), M3 (Linux, Android).
std::vector<int> halda_cases(const std::vector<HaldaDevice>& devices, const HaldaModel& model,
                             const std::vector<int>& windows, const std::vector<int>& gpu_layers,
                             int k, double min_disk_bytes_per_s = 1e8);

/// Halda (prima.cpp §4, Algorithm 1): windows initialised in proportion to the memory
/// budgets; then, until the case assignment and the solution stop changing, for every k that
/// divides L an integer program in (w, n) (minimise T; sum w = L / k; 1 <= w_m; 0 <= n_m <= w_m;
/// n_m within VRAM; each device's RAM row of its case) solved by CBC, the best k kept; a
/// device with free VRAM while others overflow forces the slowest-disk device into M4. With
/// remove_devices, devices other than the head left with w_m = 1 and n_m = 0 are removed and
/// the rest solved again.
/// @throws brigade::Error{InvalidArgument} naming the device and field for a profile that is
///         not usable (a rate <= 0, an unknown os or gpu), no devices, a model with L < 1, or
///         fixed_k not dividing L; {Infeasible... as InvalidArgument} "halda: no assignment of
///         the L layers fits the devices' memory" when no k has a solution
HaldaResult halda(const std::vector<HaldaDevice>& devices, const HaldaModel& model,
                  const HaldaOptions& options = {});

/// The even split prima.cpp compares against: k = 1, the L layers spread over the devices in
/// order (sizes differing by at most one), on each GPU as many of its layers as its VRAM holds;
/// the cases those put the devices in and the latency model's T.
/// @throws brigade::Error{InvalidArgument} as halda() for unusable profiles, or more devices
///         than layers
HaldaResult halda_even_split(const std::vector<HaldaDevice>& devices, const HaldaModel& model);

/// Per device of an assignment, bytes held: RAM (the CPU layers' weights and KV that fit, the
/// head's input row and output), VRAM (the GPU layers), and bytes read from disk per token
/// (what of the CPU layers does not fit RAM, in M1-M3). 0 for a removed device.
struct HaldaMemory {
  double ram_bytes = 0, vram_bytes = 0, disk_bytes_per_token = 0;
};
std::vector<HaldaMemory> halda_memory(const std::vector<HaldaDevice>& devices,
                                      const HaldaModel& model, const HaldaResult& r);

/// Reads a devices file: {"schema": "brigade.halda_devices/1", "devices": [{"name", "os",
/// "gpu", "cpu_flops_per_s", "cpu_memory_bytes_per_s", "gpu_flops_per_s",
/// "gpu_memory_bytes_per_s", "ram_bytes", "vram_bytes", "swap_bytes", "disk_bytes_per_s",
/// "link_seconds"}, ...]} (docs/ring.md).
/// @throws brigade::Error{BadFile} naming the file and the field for a missing or wrong field
std::vector<HaldaDevice> load_halda_devices(const std::filesystem::path& path);

}  // namespace v0
}  // namespace brigade::partition
