// brigade::cost::DeviceProfile: what a device can do, measured on this machine (`brigade profile`)
// or written by hand from a datasheet, so planners and cost models work for machines we do not
// have. docs/profiles.md documents the JSON schema.
#pragma once

#include "brigade/core/error.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::cost {
inline namespace v0 {

/// The schema tag every profile carries ("schema" field).
inline constexpr std::string_view kProfileSchema = "brigade.device_profile/1";

/// Product rate of a projection: `rows` activation rows times a weight, on `threads` threads
/// (CPU: intra-op threads of one product; GPU: 1 = the device).
struct GemmPoint {
  std::int64_t rows = 1;     ///< activation rows (decode: sequences of a micro-batch; prefill: tokens)
  int threads = 1;           ///< threads (CPU) the product ran on, >= 1
  double flops_per_s = 0.0;  ///< FLOP/s (a multiply-add counts 2), > 0
};

/// Attention cost of one query token against `context` cached positions, per head of
/// `head_dim` (decode attention: QK^T, softmax, PV over the KV cache).
struct AttentionPoint {
  std::int64_t context = 1;             ///< cached positions attended to, >= 1
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
  std::vector<GemmPoint> gemm;            ///< at least one point; see gemm_flops_per_s()
  std::vector<AttentionPoint> attention;  ///< at least one point; see attention_seconds()
  double core_bytes_per_s = 0.0;    ///< one core (CPU) / the device streaming memory, bytes/s, > 0
  double memory_bytes_per_s = 0.0;  ///< all `cores` streaming at once, bytes/s, > 0
  double memory_capacity_bytes = 0.0;  ///< RAM (CPU) or VRAM (GPU) for weights, KV cache and
                                       ///< activations, bytes, > 0
  double disk_bytes_per_s = 0.0;    ///< reading weights from storage (offload), bytes/s, > 0
  std::vector<LinkProfile> links;   ///< at least one

  /// FLOP/s of a product of `rows` rows on `threads` threads: the points of that thread count
  /// (else the largest count <= threads, else the smallest), interpolated linearly in log(rows)
  /// between the nearest measured row counts and held constant beyond them.
  /// @throws brigade::Error{InvalidArgument} if rows or threads < 1
  [[nodiscard]] double gemm_flops_per_s(std::int64_t rows, int threads = 1) const;
  /// Seconds of attention for `tokens` query tokens of `heads` heads of size `head_dim` against
  /// `context` cached positions: the points' seconds per token and head, interpolated linearly in
  /// context (extrapolated proportionally to context beyond the last point), scaled by
  /// head_dim / the point's head_dim.
  /// @throws brigade::Error{InvalidArgument} for a count < 1
  [[nodiscard]] double attention_seconds(std::int64_t tokens, int heads, int head_dim,
                                         double context) const;
  /// The link of `transport`.
  /// @throws brigade::Error{InvalidArgument} naming the transport and the ones the profile has
  [[nodiscard]] const LinkProfile& link(std::string_view transport) const;
  /// Checks that `bytes` fit in memory_capacity_bytes.
  /// @throws brigade::Error{InvalidArgument} "<what>: <bytes> bytes do not fit in <name>'s
  ///         <capacity> bytes" (the caller names the rank in `what`)
  void check_fits(double bytes, std::string_view what) const;

  /// Checks every field: the schema's ranges and at least one point of each list.
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
  /// Activation rows of the GEMM points (decode rows, then prefill rows).
  std::vector<std::int64_t> rows{1, 2, 4, 8, 16, 32, 64, 128, 512};
  std::int64_t gemm_in = 512;    ///< weight columns (the model width)
  std::int64_t gemm_out = 1376;  ///< weight rows (e.g. the FFN width)
  std::vector<std::int64_t> contexts{64, 256, 1024, 4096};  ///< attention points
  int head_dim = 64;
  /// Triad footprint per thread, and the bytes of weight copies the products cycle through.
  std::int64_t stream_bytes = std::int64_t{96} << 20;
  std::int64_t disk_bytes = std::int64_t{256} << 20;   ///< file written then read back, bytes
  std::filesystem::path disk_dir;  ///< where that file goes (empty: the temporary directory)
  double seconds_per_point = 0.05; ///< repetition budget of each point (best repetition counts)
};

/// Measures this machine (CPU): matmul_wt FP32 rates at options.rows on 1 thread and on
/// options.cores threads (weights read from memory: each repetition takes the next of enough
/// copies to fill options.stream_bytes), decode attention at options.contexts, STREAM triad bandwidth of one
/// core and of all, the in-process transport's latency (ping-pong of empty messages) and
/// bandwidth (16 MiB messages), the disk read rate of a file written, synced and dropped from
/// the page cache (posix_fadvise DONTNEED; where the kernel keeps it cached anyway the rate is
/// the page cache's, and `source` says so), and the physical memory (sysconf).
/// @throws brigade::Error{InvalidArgument} for options out of range; {BadFile} if the disk file
///         cannot be written
DeviceProfile measure_profile(const ProfileOptions& options);

}  // namespace v0
}  // namespace brigade::cost
