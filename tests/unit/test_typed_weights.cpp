// Weights kept in F16, BF16 and Q8_0: llama.cpp's Q8_0 blocks, exact dequantization, and
// matmul_wt / embedding over typed weights giving the bits of the float32 kernels on the
// dequantized matrix, for every instruction set this CPU has.
#include "brigade/backend/cpu.hpp"
#include "brigade/core/dtype.hpp"
#include "brigade/core/error.hpp"
#include "brigade/model/weight_matrix.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using brigade::DType;
using brigade::Error;
namespace cpu = brigade::cpu;
namespace model = brigade::model;
using Vec = std::vector<float>;

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

using brigade::test::random_vec;

/// `w` [rows x cols] stored in `t` (the bytes), and its dequantized float32 copy.
struct Typed {
  std::vector<std::byte> bytes;
  Vec f32;
  model::WeightMatrix view() const { return {bytes.data(), t}; }
  DType t;
};

Typed make_typed(const Vec& w, std::int64_t rows, std::int64_t cols, DType t) {
  Typed out{std::vector<std::byte>(sz(rows) * model::weight_row_bytes(t, cols)), Vec(w.size()), t};
  model::quantize_rows(w.data(), rows, cols, t, out.bytes.data());
  model::dequantize_rows(out.view(), cols, 0, rows, out.f32.data());
  return out;
}

bool same_bits(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("typed_weights.q8_0: blocks are llama.cpp's block_q8_0 (f16 d = amax / 127, "
          "q = roundf(x / d), halves away from zero)") {
  // One row of 64: block 0 has amax 127 (d = 1, so q = roundf(x) exactly), block 1 is all zero.
  Vec x(64, 0.0f);
  x[0] = 127.0f;
  x[1] = 2.5f;    // a half: away from zero, 3 (nearbyint would give 2)
  x[2] = -2.5f;   // -3
  x[3] = 0.49f;   // 0
  x[4] = -126.6f; // -127
  std::vector<std::byte> b(model::weight_row_bytes(DType::Q8_0, 64));
  REQUIRE(b.size() == 68);
  model::quantize_rows(x.data(), 1, 64, DType::Q8_0, b.data());
  std::uint16_t d0, d1;
  std::memcpy(&d0, b.data(), 2);
  std::memcpy(&d1, b.data() + 34, 2);
  CHECK(d0 == brigade::f32_to_f16(1.0f));
  CHECK(d1 == 0);
  const auto* q = reinterpret_cast<const std::int8_t*>(b.data() + 2);
  CHECK(q[0] == 127);
  CHECK(q[1] == 3);
  CHECK(q[2] == -3);
  CHECK(q[3] == 0);
  CHECK(q[4] == -127);
  for (int i = 0; i < 32; ++i) CHECK(static_cast<int>(b[sz(36 + i)]) == 0);
  Vec back(64);
  model::dequantize_rows({b.data(), DType::Q8_0}, 64, 0, 1, back.data());
  CHECK(back[1] == 3.0f);
  CHECK(back[4] == -127.0f);
  CHECK(back[40] == 0.0f);

  // A random row: d is amax / 127 rounded to f16, every value within d/2 (+ the scale's
  // rounding) of x.
  std::mt19937 rng(3);
  const Vec r = random_vec(rng, 96, -0.3f, 0.2f);
  const Typed t = make_typed(r, 1, 96, DType::Q8_0);
  for (int blk = 0; blk < 3; ++blk) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(r[sz(blk * 32 + i)]));
    std::uint16_t h;
    std::memcpy(&h, t.bytes.data() + blk * 34, 2);
    CHECK(h == brigade::f32_to_f16(amax / 127.0f));
    const float d = brigade::f16_to_f32(h);
    for (int i = 0; i < 32; ++i) {
      const auto qi = static_cast<std::int8_t>(t.bytes[sz(blk * 34 + 2 + i)]);
      CHECK(qi == static_cast<int>(std::round(r[sz(blk * 32 + i)] * (1.0f / (amax / 127.0f)))));
      CHECK(t.f32[sz(blk * 32 + i)] == static_cast<float>(qi) * d);
    }
  }
}

TEST_CASE("typed_weights: F16 and BF16 rows are the rounded values, bad dtypes and partial Q8_0 "
          "rows are refused") {
  const Vec w{1.0f, 0.1f, -3.14159f, 65504.0f, 1e-7f, -0.0f};
  const Typed h = make_typed(w, 2, 3, DType::F16);
  const Typed b = make_typed(w, 3, 2, DType::BF16);
  for (std::size_t i = 0; i < w.size(); ++i) {
    CHECK(h.f32[i] == brigade::f16_to_f32(brigade::f32_to_f16(w[i])));
    CHECK(b.f32[i] == brigade::bf16_to_f32(brigade::f32_to_bf16(w[i])));
  }
  CHECK(model::weight_row_bytes(DType::F32, 5) == 20);
  CHECK(model::weight_row_bytes(DType::BF16, 5) == 10);
  CHECK(model::weight_row_bytes(DType::Q8_0, 96) == 102);
  CHECK_THROWS_WITH_AS(model::weight_row_bytes(DType::Q8_0, 48),
                       "weight_row_bytes: q8_0 rows of 48 elements are not whole blocks of 32 "
                       "(rows are never padded)",
                       Error);
  CHECK_THROWS_WITH_AS(model::weight_row_bytes(DType::I32, 4),
                       "weight_row_bytes: dtype i32 is not a weight dtype (f32, f16, bf16, q8_0)",
                       Error);
  Vec x(48, 1.0f), y(2);
  std::vector<std::byte> q(200);
  CHECK_THROWS_WITH_AS(cpu::matmul_wt(x.data(), {q.data(), DType::Q8_0}, y.data(), 1, 48, 2),
                       "matmul_wt: q8_0 rows of 48 elements are not whole blocks of 32 (rows "
                       "are never padded)",
                       Error);
  CHECK_THROWS_AS(cpu::matmul_wt_accumulate(x.data(), {q.data(), DType::U8}, y.data(), 1, 48, 2),
                  Error);
  CHECK_THROWS_AS(model::WeightMatrix(q.data(), DType::F16).f32(), Error);
  CHECK(model::WeightMatrix(x.data()).f32() == x.data());
}

TEST_CASE("typed_weights.matmul_wt: F16, BF16 and Q8_0 give the bits of the float32 W they "
          "dequantize to, T = 1..64 and beyond, every instruction set") {
  const cpu::KernelIsa before = cpu::kernel_isa();
  std::mt19937 rng(17);
  int isas = 0;
  for (auto isa : {cpu::KernelIsa::Generic, cpu::KernelIsa::Avx2, cpu::KernelIsa::Avx512}) {
    if (!cpu::kernel_isa_supported(isa)) continue;
    cpu::set_kernel_isa(isa);
    ++isas;
    for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0}) {
      // Odd K (the K % 16 tail) and odd N (rows outside the kernel's segments) for the 16-bit
      // types; Q8_0 rows are whole blocks of 32.
      const std::vector<std::pair<std::int64_t, std::int64_t>> shapes =
          t == DType::Q8_0
              ? std::vector<std::pair<std::int64_t, std::int64_t>>{{32, 7}, {96, 129}, {512, 37}}
              : std::vector<std::pair<std::int64_t, std::int64_t>>{{7, 11}, {172, 129}, {512, 37}};
      for (auto [in, out] : shapes) {
        const Typed w = make_typed(random_vec(rng, out * in, -0.5f, 0.5f), out, in, t);
        const Vec x_all = random_vec(rng, 80 * in);
        const Vec base = random_vec(rng, 80 * out);
        int wrong = 0;
        for (std::int64_t rows = 1; rows <= 80; rows += rows < 64 ? 1 : 16) {
          CAPTURE(cpu::to_string(isa));
          CAPTURE(brigade::to_string(t));
          CAPTURE(in);
          CAPTURE(rows);
          Vec y(sz(rows * out)), ref(sz(rows * out));
          cpu::matmul_wt(x_all.data(), w.view(), y.data(), rows, in, out);
          cpu::matmul_wt(x_all.data(), w.f32.data(), ref.data(), rows, in, out);
          wrong += !same_bits(y, ref);
          Vec acc(base.begin(), base.begin() + rows * out), acc_ref = acc;
          cpu::matmul_wt_accumulate(x_all.data(), w.view(), acc.data(), rows, in, out);
          cpu::matmul_wt_accumulate(x_all.data(), w.f32.data(), acc_ref.data(), rows, in, out);
          wrong += !same_bits(acc, acc_ref);
          if (rows == 80) {  // the GEMM path, against a double reference too
            double err = 0.0, scale = 0.0;
            for (std::int64_t r = 0; r < rows; ++r)
              for (std::int64_t n = 0; n < out; ++n) {
                double s = 0.0;
                for (std::int64_t k = 0; k < in; ++k)
                  s += double(x_all[sz(r * in + k)]) * double(w.f32[sz(n * in + k)]);
                err = std::max(err, std::abs(s - double(y[sz(r * out + n)])));
                scale = std::max(scale, std::abs(s));
              }
            CHECK(err <= 1e-5 * scale);
          }
        }
        CHECK(wrong == 0);
      }
    }
  }
  cpu::set_kernel_isa(before);
  CHECK(isas >= 1);
}

TEST_CASE("typed_weights.embedding: a typed table's rows are the dequantized rows") {
  std::mt19937 rng(9);
  const std::int64_t vocab = 10, dim = 64;
  const Vec table = random_vec(rng, vocab * dim);
  const std::vector<std::int32_t> ids{3, 0, 9, 3};
  for (DType t : {DType::F16, DType::BF16, DType::Q8_0}) {
    CAPTURE(brigade::to_string(t));
    const Typed w = make_typed(table, vocab, dim, t);
    Vec out(ids.size() * sz(dim)), ref(out.size());
    cpu::embedding(w.view(), ids.data(), out.data(), 4, dim);
    cpu::embedding(w.f32.data(), ids.data(), ref.data(), 4, dim);
    CHECK(same_bits(out, ref));
    CHECK(out[sz(dim) + 5] == w.f32[5]);  // row 0, column 5
  }
}
