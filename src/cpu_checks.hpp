// Argument checks shared by the CPU kernel files (internal to src/).
#pragma once

#include "brigade/core/error.hpp"

#include <cstdint>

namespace brigade::cpu::detail {

/// @throws brigade::Error{InvalidArgument} naming `what` if a GEMM dimension is negative
inline void check_gemm_shape(const char* what, std::int64_t tokens, std::int64_t in,
                             std::int64_t out_dim) {
  BRIGADE_CHECK(tokens >= 0 && in >= 0 && out_dim >= 0, Errc::InvalidArgument,
                "{}: shape tokens = {}, in = {}, out = {}; expected all >= 0", what, tokens, in,
                out_dim);
}

/// @throws brigade::Error{InvalidArgument} naming `what` unless n_heads and n_kv_heads are
///         positive with n_kv_heads dividing n_heads, and head_size is positive and even
inline void check_heads(const char* what, int n_heads, int n_kv_heads, int head_size) {
  BRIGADE_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0,
                Errc::InvalidArgument,
                "{}: n_heads = {}, n_kv_heads = {}; expected both > 0 and n_heads a multiple "
                "of n_kv_heads",
                what, n_heads, n_kv_heads);
  BRIGADE_CHECK(head_size > 0 && head_size % 2 == 0, Errc::InvalidArgument,
                "{}: head_size = {}; expected a positive even number", what, head_size);
}

}  // namespace brigade::cpu::detail
