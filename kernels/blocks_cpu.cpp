// y = x W^T + bias for a weight W [N, K] held as 4-bit blocks that reconstruct its fp32 values exactly
// (kernels/blocks.py): W[n, 32 b + t] = d[n, b] * q + m[n, b] in fp32 with two roundings, a product and
// then a sum. This file is compiled with -ffp-contract=off so that no compiler fuses them into one fma,
// which rounds once and could give another fp32 value.
//
// Layout, per group g of 16 rows of W (n = 16 g + l) and block b of 32 columns:
//   codes [N / 16, K / 32, 16, 16] uint8: codes[g, b, j, l] holds q of column 32 b + j in its low nibble
//                                        and of column 32 b + 16 + j in its high nibble;
//   d, m  [N / 16, K / 32, 16] fp32.
// One 16-byte load then expands into the weights of 16 rows at two columns, and every row i of x adds
// x[i, k] * W[16 g : 16 g + 16, k] to 16 sums held in one register: no horizontal sums, and a step's
// few rows share each expansion. The products are fp32 sums in another order than oneDNN's (equal to
// them to fp32 rounding); a step reads 5 bits a weight instead of 32.
//
// 8-bit blocks (GGUF's Q8_0, as an LM head often is) are W[n, 32 b + t] = d[n, b] * q, q an int8, one
// exact product: codes [N / 16, K / 32, 32, 16] int8 (codes[g, b, t, l] the q of column 32 b + t), d as
// above; 8.5 bits a weight.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <utility>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t GROUP = 16;
constexpr int TILE = 16;  // rows of x multiplied per expansion

template <int MB>
void group_rows(const float* x, const uint8_t* codes, const float* d, const float* m, int64_t g, int64_t i0,
                int64_t K, int64_t N, const float* bias, float* y) {
  const int64_t blocks = K / BLOCK;
  const uint8_t* c = codes + g * blocks * 256;
  const float* dg = d + g * blocks * GROUP;
  const float* mg = m + g * blocks * GROUP;
  const float* xr = x + i0 * K;
#if defined(__AVX512F__)
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 scale = _mm512_loadu_ps(dg + b * GROUP), low = _mm512_loadu_ps(mg + b * GROUP);
    const uint8_t* cb = c + b * 256;
    const int64_t k0 = b * BLOCK;
    for (int j = 0; j < 16; ++j) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + j * 16)));
      const __m512 w_lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, nibble)), scale), low);
      const __m512 w_hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), scale), low);
      for (int i = 0; i < MB; ++i) {
        acc[i] = _mm512_fmadd_ps(w_lo, _mm512_set1_ps(xr[i * K + k0 + j]), acc[i]);
        acc[i] = _mm512_fmadd_ps(w_hi, _mm512_set1_ps(xr[i * K + k0 + 16 + j]), acc[i]);
      }
    }
  }
  const __m512 add = bias ? _mm512_loadu_ps(bias + g * GROUP) : _mm512_setzero_ps();
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(y + (i0 + i) * N + g * GROUP, _mm512_add_ps(acc[i], add));
#else
  float acc[MB][GROUP] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* cb = c + b * 256;
    for (int j = 0; j < 16; ++j)
      for (int l = 0; l < GROUP; ++l) {
        const uint8_t code = cb[j * 16 + l];
        float w_lo = dg[b * GROUP + l] * static_cast<float>(code & 15);
        w_lo = w_lo + mg[b * GROUP + l];
        float w_hi = dg[b * GROUP + l] * static_cast<float>(code >> 4);
        w_hi = w_hi + mg[b * GROUP + l];
        for (int i = 0; i < MB; ++i)
          acc[i][l] += w_lo * xr[i * K + b * BLOCK + j] + w_hi * xr[i * K + b * BLOCK + 16 + j];
      }
  }
  for (int i = 0; i < MB; ++i)
    for (int l = 0; l < GROUP; ++l) y[(i0 + i) * N + g * GROUP + l] = acc[i][l] + (bias ? bias[g * GROUP + l] : 0.f);
#endif
}

// the same for 8-bit blocks: W[n, 32 b + t] = d[n, b] * q (q = int8 of codes[g, b, t, l], an exact product),
// codes [N / 16, K / 32, 32, 16] int8, d [N / 16, K / 32, 16] fp32
template <int MB>
void group_rows8(const float* x, const uint8_t* codes, const float* d, const float*, int64_t g, int64_t i0,
                 int64_t K, int64_t N, const float* bias, float* y) {
  const int64_t blocks = K / BLOCK;
  const int8_t* c = reinterpret_cast<const int8_t*>(codes) + g * blocks * 512;
  const float* dg = d + g * blocks * GROUP;
  const float* xr = x + i0 * K;
#if defined(__AVX512F__)
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 scale = _mm512_loadu_ps(dg + b * GROUP);
    const int8_t* cb = c + b * 512;
    const int64_t k0 = b * BLOCK;
    for (int t = 0; t < 32; ++t) {
      const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + t * 16)));
      const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(v), scale);
      for (int i = 0; i < MB; ++i) acc[i] = _mm512_fmadd_ps(w, _mm512_set1_ps(xr[i * K + k0 + t]), acc[i]);
    }
  }
  const __m512 add = bias ? _mm512_loadu_ps(bias + g * GROUP) : _mm512_setzero_ps();
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(y + (i0 + i) * N + g * GROUP, _mm512_add_ps(acc[i], add));
#else
  float acc[MB][GROUP] = {};
  for (int64_t b = 0; b < blocks; ++b)
    for (int t = 0; t < 32; ++t)
      for (int l = 0; l < GROUP; ++l) {
        const float w = dg[b * GROUP + l] * static_cast<float>(c[(b * 32 + t) * 16 + l]);
        for (int i = 0; i < MB; ++i) acc[i][l] += w * xr[i * K + b * BLOCK + t];
      }
  for (int i = 0; i < MB; ++i)
    for (int l = 0; l < GROUP; ++l) y[(i0 + i) * N + g * GROUP + l] = acc[i][l] + (bias ? bias[g * GROUP + l] : 0.f);
#endif
}

using GroupRows = void (*)(const float*, const uint8_t*, const float*, const float*, int64_t, int64_t, int64_t,
                           int64_t, const float*, float*);

template <int... MB>
constexpr std::array<GroupRows, sizeof...(MB)> table(std::integer_sequence<int, MB...>) {
  return {&group_rows<MB + 1>...};
}

template <int... MB>
constexpr std::array<GroupRows, sizeof...(MB)> table8(std::integer_sequence<int, MB...>) {
  return {&group_rows8<MB + 1>...};
}

}  // namespace

// x [M, K] times the 4-bit (codes uint8 [N / 16, K / 32, 16, 16], d and m) or 8-bit (codes int8
// [N / 16, K / 32, 32, 16], d; m empty) block weight [N, K], plus bias
torch::Tensor block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: a contiguous fp32 [M, K]");
  const bool eight = codes.scalar_type() == torch::kChar;
  TORCH_CHECK(codes.dim() == 4 && (eight || codes.scalar_type() == torch::kByte) && codes.is_contiguous() &&
              codes.size(2) == (eight ? 32 : 16) && codes.size(3) == GROUP,
              "codes: uint8 [N / 16, K / 32, 16, 16] or int8 [N / 16, K / 32, 32, 16]");
  const int64_t M = x.size(0), K = x.size(1), groups = codes.size(0), N = groups * GROUP;
  TORCH_CHECK(codes.size(1) * BLOCK == K, "codes cover ", codes.size(1) * BLOCK, " columns, x has ", K);
  TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.numel() == N * K / BLOCK &&
              (eight || (m.scalar_type() == torch::kFloat && m.is_contiguous() && m.numel() == N * K / BLOCK)),
              "d, m: fp32 [N / 16, K / 32, 16]");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: fp32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  static const auto kernels4 = table(std::make_integer_sequence<int, TILE>{});
  static const auto kernels8 = table8(std::make_integer_sequence<int, TILE>{});
  const auto& kernels = eight ? kernels8 : kernels4;
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = eight ? nullptr : m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t i = 0; i < M; i += TILE)
        kernels[std::min<int64_t>(TILE, M - i) - 1](xp, cp, dp, mp, g, i, K, N, bias_ptr, yp);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("block_linear", &block_linear, "x [M, K] fp32 times a 4-bit or 8-bit block weight [N, K], plus bias");
}
