// brigade::cost::DeviceProfile: what a device can do, measured on this machine (`brigade profile`)
// or written by hand from a datasheet, so planners and cost models work for machines we do not
// have. docs/profiles.md documents the JSON schema.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/model/layer_cost.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::cost {
inline namespace v0 {

/// The schema tag every profile carries ("schema" field).
inline constexpr std::string_view kProfileSchema = "brigade.device_profile/2";

/// Product rate of a projection y = x W^T of `rows` activation rows, or of one of its
/// gradients, on `threads` threads (CPU: intra-op threads of one product; GPU: 1 = the device).
struct GemmPoint {
  /// Which product: Phase::Forward (y = x W^T: prefill, decode and the training forward),
  /// Phase::BackwardInput (dx = dy W) or Phase::BackwardWeight (dW += dy^T x); JSON "product":
  /// "forward", "backward_input", "backward_weight".
  model::Phase product = model::Phase::Forward;
  std::int64_t rows = 1;     ///< activation rows (decode: sequences of a micro-batch; prefill: tokens)
  int threads = 1;           ///< threads (CPU) the product ran on, >= 1
  double flops_per_s = 0.0;  ///< FLOP/s (a multiply-add counts 2), > 0
  /// Cores running products at once while this point was measured (the others each ran the
  /// same product on their own weights): 0 = `threads`, the product alone; otherwise >=
  /// threads. A pipeline of S stages of T threads keeps S x T cores busy, and one core's rate
  /// then drops (shared memory bandwidth and caches, a lower all-core clock): on the 2-core AMD
  /// EPYC of docs/benchmarks.md by 10-25%. JSON "busy_cores", optional.
  int busy_cores = 0;
};

/// Attention cost per query token and head of `head_dim`, at a mean of `context` attended
/// positions. `phase`: Phase::Decode (one query token against `context` cached positions:
/// QK^T, softmax, PV over the KV cache; used for prefill tokens too), Phase::Forward (training:
/// causal attention over packed sequences of 2 context - 1 tokens, keeping the log-sum-exp) or
/// Phase::BackwardInput (its backward: dQ, dK, dV); JSON "phase": "decode", "forward",
/// "backward_input".
struct AttentionPoint {
  model::Phase phase = model::Phase::Decode;
  std::int64_t context = 1;             ///< positions attended to (mean, in training), >= 1
  int head_dim = 64;                    ///< head size, >= 1
  double seconds_per_token_head = 0.0;  ///< seconds per query token per head, > 0
};

/// A transport between two workers of this device kind: a message of b bytes takes
/// latency_s + b / bytes_per_s seconds.
struct LinkProfile {
  std::string transport;    ///< "in-process", "mpi", "nccl", "pcie", "nvlink", ...
  double latency_s = 0.0;   ///< seconds, >= 0
  double bytes_per_s = 0.0; ///< bytes per second, > 0
};

/// One device: its products, attention, memory, disk and links.
struct DeviceProfile {
  std::string name;    ///< e.g. "AMD EPYC 7B13 (2 cores)" or "NVIDIA H200 SXM"
  std::string kind;    ///< "cpu" or "gpu"
  std::string source;  ///< how it was obtained: "measured by brigade profile on <date>", a datasheet
  std::string dtype;   ///< the product and attention dtype: "f32", "bf16", "f16"
  int cores = 1;       ///< CPU cores the rates may use (a GPU: 1)
  /// At least one point of each product (forward, backward_input, backward_weight); see
  /// gemm_flops_per_s()
  std::vector<GemmPoint> gemm;
  /// At least one point of each phase (decode, forward, backward_input); see attention_seconds()
  std::vector<AttentionPoint> attention;
  double core_bytes_per_s = 0.0;    ///< one core (CPU) / the device streaming memory, bytes/s, > 0
  double memory_bytes_per_s = 0.0;  ///< all `cores` streaming at once, bytes/s, > 0
  double memory_capacity_bytes = 0.0;  ///< RAM (CPU) or VRAM (GPU) for weights, KV cache and
                                       ///< activations, bytes, > 0
  double disk_bytes_per_s = 0.0;    ///< reading weights from storage (offload), bytes/s, > 0
  std::vector<LinkProfile> links;   ///< at least one

  /// FLOP/s of product `product` (Forward, BackwardInput, BackwardWeight) of `rows` rows on
  /// `threads` threads while `busy_cores` cores run products at once (0: `threads`, the
  /// product alone): the points of that product and thread count (else the largest count
  /// <= threads, else the smallest) whose busy cores are the largest <= busy_cores (else the
  /// product alone), interpolated linearly in log(rows) between the nearest measured row
  /// counts and held constant beyond them.
  /// @throws brigade::Error{InvalidArgument} if rows or threads < 1, busy_cores < 0, or for
  ///         another phase
  [[nodiscard]] double gemm_flops_per_s(std::int64_t rows, int threads = 1,
                                        model::Phase product = model::Phase::Forward,
                                        int busy_cores = 0) const;
  /// Seconds of attention in `phase` (Decode, Forward, BackwardInput) for `tokens` query tokens
  /// of `heads` heads of size `head_dim` at a mean of `context` attended positions: the phase's
  /// points' seconds per token and head, interpolated linearly in context (extrapolated
  /// proportionally to context beyond the last point), scaled by head_dim / the point's head_dim.
  /// @throws brigade::Error{InvalidArgument} for a count < 1, or for another phase
  [[nodiscard]] double attention_seconds(std::int64_t tokens, int heads, int head_dim,
                                         double context,
                                         model::Phase phase = model::Phase::Decode) const;
  /// The link of `transport`.
  /// @throws brigade::Error{InvalidArgument} naming the transport and the ones the profile has
  [[nodiscard]] const LinkProfile& link(std::string_view transport) const;
  /// Checks that `bytes` fit in memory_capacity_bytes.
  /// @throws brigade::Error{InvalidArgument} "<what>: <bytes> bytes do not fit in <name>'s
  ///         <capacity> bytes" (the caller names the rank in `what`)
  void check_fits(double bytes, std::string_view what) const;

  /// Checks every field: the schema's ranges, at least one point of each product and attention
  /// phase, and at least one link.
  /// @throws brigade::Error{InvalidArgument} naming the field (e.g. "gemm[2].flops_per_s") and
  ///         the value
  void validate() const;
};

/// The profile as JSON (the schema of docs/profiles.md).
nlohmann::json to_json(const DeviceProfile& p);
/// A profile from JSON, validated.
/// @param where names the source in messages (a file name)
/// @throws brigade::Error{InvalidArgument} naming `where` and the field that is missing, of the
///         wrong type or out of range, or a schema tag other than kProfileSchema
DeviceProfile profile_from_json(const nlohmann::json& j, std::string_view where = "profile");
/// Reads a profile file (at most 16 MiB).
/// @throws brigade::Error{BadFile} if it cannot be read or is not JSON; as profile_from_json()
DeviceProfile load_profile(const std::filesystem::path& path);
/// Writes `p` atomically (validated first).
/// @throws brigade::Error{InvalidArgument} as validate(); {BadFile} if it cannot be written
void save_profile(const std::filesystem::path& path, const DeviceProfile& p);

/// What measure_profile() measures.
struct ProfileOptions {
  int cores = 1;  ///< cores to use (threads of the all-core measurements), >= 1
  /// Activation rows of the forward GEMM points (decode rows, then prefill rows).
  std::vector<std::int64_t> rows{1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  /// Rows of the backward GEMM points (training micro-batches' tokens).
  std::vector<std::int64_t> backward_rows{64, 256, 1024};
  std::int64_t gemm_in = 512;    ///< weight columns (the model width)
  std::int64_t gemm_out = 1376;  ///< weight rows (e.g. the FFN width)
  std::vector<std::int64_t> contexts{64, 256, 1024, 4096};  ///< decode attention points
  /// Mean contexts of the training attention points (sequences of 2 c - 1 tokens).
  std::vector<std::int64_t> training_contexts{32, 128, 512};
  int head_dim = 64;
  /// Triad footprint per thread, and the bytes of weight copies the products cycle through.
  std::int64_t stream_bytes = std::int64_t{96} << 20;
  std::int64_t disk_bytes = std::int64_t{256} << 20;   ///< file written then read back, bytes
  std::filesystem::path disk_dir;  ///< where that file goes (empty: the temporary directory)
  double seconds_per_point = 0.05; ///< repetition budget of each point (the median repetition
                                   ///< counts)
};

/// Measures this machine (CPU): matmul_wt FP32 rates at options.rows on 1 thread alone, on 1
/// thread while the other options.cores - 1 cores run products of their own (GemmPoint::
/// busy_cores = cores), and on options.cores threads (weights read from memory: each
/// repetition takes the next of enough copies to fill options.stream_bytes); the training
/// products (matmul_wt_backward_input and
/// matmul_wt_backward_weight) at options.backward_rows on the same threads; decode attention at
/// options.contexts and the training attention (attention_varlen_forward and _backward, 8 heads,
/// one sequence of 2 c - 1 tokens) at options.training_contexts; STREAM triad bandwidth of one
/// core and of all, the in-process transport's latency (ping-pong of empty messages) and
/// bandwidth (16 MiB messages), the disk read rate of a file written, synced and dropped from
/// the page cache (posix_fadvise DONTNEED; where the kernel keeps it cached anyway the rate is
/// the page cache's, and `source` says so), and the physical memory (sysconf).
/// @throws brigade::Error{InvalidArgument} for options out of range; {BadFile} if the disk file
///         cannot be written (or there is no temporary directory and no options.disk_dir)
DeviceProfile measure_profile(const ProfileOptions& options);

}  // namespace v0
}  // namespace brigade::cost
