// y = x W^T + bias for a weight W [N, K] held as 4-bit blocks that reconstruct its fp32 values exactly
// (blocks.py): W[n, 32 b + t] = d[n, b] * q + m[n, b] in fp32, q = 0..15 and d with at most 11
// significant bits (encode accepts no other), so d * q is exact and the sum is the only rounding: an fma gives
// the same value. (The file is compiled with -ffp-contract=off all the same: no other sum may be fused.)
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
//
// With AVX-512 the 16 rows of a group are one register; with AVX2 (no AVX-512) two, each of 8 lanes, which leaves
// room for fewer rows of x per expansion (TILE), in the same layout, with the same sums in the same order.
// (On a 2-core AVX2 EPYC over SmolLM2's layer weights, computing one half of a group at a time from 4 rows on took
// 4 rows from 11.1 to 9.1 ms and 16 from 34.7 to 29.2; for 1-3 rows both halves at once stay faster.)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t GROUP = 16;
#if defined(__AVX512F__)
constexpr int TILE = 16;  // rows of x multiplied per expansion
#else
constexpr int TILE = 8;   // AVX2's 16 registers: the sums of 8 rows at one half of a group (group_rows)
#endif

// Independent sums kept per row of x: an fma waits ~4 cycles for the one before it into the same register.
// Measured on the 2-core EPYC over SmolLM2's layer weights: two sums a row for up to 8 rows, one row 5.05 ->
// 3.97 ms, two rows 5.04 -> 4.38; four sums were slower for one or two rows (5.19, 6.26). The 8-bit loop keeps one:
// two doubled its time (its 32-step inner loop then indexes the sums at run time).
template <int MB>
constexpr int chains() { return MB <= 8 ? 2 : 1; }
// the same with AVX2, whose two registers a row already make two chains: two sums a row for 1 or 2 rows (on a
// 2-core AVX2 EPYC over SmolLM2's layer weights, 3 rows took 13.3 ms with two and 9.1 with one)
template <int MB>
constexpr int chains2() { return MB <= 2 ? 2 : 1; }

#if defined(__AVX512F__)
template <int MB, int CH>
void zero_rows(__m512 (&acc)[MB][CH]) {
  for (int i = 0; i < MB; ++i)
    for (int c = 0; c < CH; ++c) acc[i][c] = _mm512_setzero_ps();
}

template <int MB, int CH>
void store_rows(__m512 (&acc)[MB][CH], const float* bias, int64_t g, int64_t i0, int64_t N, float* y) {
  const __m512 add = bias ? _mm512_loadu_ps(bias + g * GROUP) : _mm512_setzero_ps();
  for (int i = 0; i < MB; ++i) {
    __m512 sum = acc[i][0];
    for (int c = 1; c < CH; ++c) sum = _mm512_add_ps(sum, acc[i][c]);
    _mm512_storeu_ps(y + (i0 + i) * N + g * GROUP, _mm512_add_ps(sum, add));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define FLASHMM_AVX2 1
// a group's 16 sums of a row as two registers: [half][lanes 8 h .. 8 h + 7]
template <int MB, int CH>
void zero_rows(__m256 (&acc)[MB][CH][2]) {
  for (int i = 0; i < MB; ++i)
    for (int c = 0; c < CH; ++c) acc[i][c][0] = acc[i][c][1] = _mm256_setzero_ps();
}

template <int MB, int CH>
void store_rows(__m256 (&acc)[MB][CH][2], const float* bias, int64_t g, int64_t i0, int64_t N, float* y) {
  for (int h = 0; h < 2; ++h) {
    const __m256 add = bias ? _mm256_loadu_ps(bias + g * GROUP + 8 * h) : _mm256_setzero_ps();
    for (int i = 0; i < MB; ++i) {
      __m256 sum = acc[i][0][h];
      for (int c = 1; c < CH; ++c) sum = _mm256_add_ps(sum, acc[i][c][h]);
      _mm256_storeu_ps(y + (i0 + i) * N + g * GROUP + 8 * h, _mm256_add_ps(sum, add));
    }
  }
}

// 8 bytes widened to 8 int32 lanes, unsigned or signed
inline __m256i widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i widen_i8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
// 8 bf16 values widened to fp32 (exact: the bits moved up 16)
inline __m256 widen_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

template <int MB>
void group_rows(const float* x, const uint8_t* codes, const float* d, const float* m, int64_t g, int64_t i0,
                int64_t K, int64_t N, const float* bias, float* y) {
  const int64_t blocks = K / BLOCK;
  const uint8_t* c = codes + g * blocks * 256;
  const float* dg = d + g * blocks * GROUP;
  const float* mg = m + g * blocks * GROUP;
  const float* xr = x + i0 * K;
#if defined(__AVX512F__)
  constexpr int CH = chains<MB>();
  __m512 acc[MB][CH];
  zero_rows<MB, CH>(acc);
  const __m512i nibble = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 scale = _mm512_loadu_ps(dg + b * GROUP), low = _mm512_loadu_ps(mg + b * GROUP);
    const uint8_t* cb = c + b * 256;
    const int64_t k0 = b * BLOCK;
    for (int j = 0; j < 16; ++j) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + j * 16)));
      // d * q is exact (d has at most 11 significant bits, q 4), so one fma rounds d * q + m as the
      // product-then-sum does: the same fp32 weight in one instruction
      const __m512 w_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, nibble)), scale, low);
      const __m512 w_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), scale, low);
      for (int i = 0; i < MB; ++i) {
        __m512& lo_sum = acc[i][(2 * j) % CH];
        __m512& hi_sum = acc[i][(2 * j + 1) % CH];
        lo_sum = _mm512_fmadd_ps(w_lo, _mm512_set1_ps(xr[i * K + k0 + j]), lo_sum);
        hi_sum = _mm512_fmadd_ps(w_hi, _mm512_set1_ps(xr[i * K + k0 + 16 + j]), hi_sum);
      }
    }
  }
  store_rows<MB, CH>(acc, bias, g, i0, N, y);
#elif defined(FLASHMM_AVX2)
  const __m256i nibble = _mm256_set1_epi32(15);
  if constexpr (MB <= 3) {  // both halves of the group at once: each code byte widened once for all 16 rows
    constexpr int CH = chains2<MB>();
    __m256 acc[MB][CH][2];
    zero_rows<MB, CH>(acc);
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256 scale[2] = {_mm256_loadu_ps(dg + b * GROUP), _mm256_loadu_ps(dg + b * GROUP + 8)};
      const __m256 low[2] = {_mm256_loadu_ps(mg + b * GROUP), _mm256_loadu_ps(mg + b * GROUP + 8)};
      const uint8_t* cb = c + b * 256;
      const int64_t k0 = b * BLOCK;
      for (int j = 0; j < 16; ++j)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = widen_u8(cb + j * 16 + 8 * h);
          // the same exact one-fma rebuild as above
          const __m256 w_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, nibble)), scale[h], low[h]);
          const __m256 w_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), scale[h], low[h]);
          for (int i = 0; i < MB; ++i) {
            __m256& lo_sum = acc[i][(2 * j) % CH][h];
            __m256& hi_sum = acc[i][(2 * j + 1) % CH][h];
            lo_sum = _mm256_fmadd_ps(w_lo, _mm256_set1_ps(xr[i * K + k0 + j]), lo_sum);
            hi_sum = _mm256_fmadd_ps(w_hi, _mm256_set1_ps(xr[i * K + k0 + 16 + j]), hi_sum);
          }
        }
    }
    store_rows<MB, CH>(acc, bias, g, i0, N, y);
  } else {  // one half of the group at a time: half the sums live, so more rows share each expansion without
            // spilling (the second half reads the group's codes from cache)
    constexpr int CH = MB <= 4 ? 2 : 1;
    for (int h = 0; h < 2; ++h) {
      __m256 acc[MB][CH][1];
      for (int i = 0; i < MB; ++i)
        for (int u = 0; u < CH; ++u) acc[i][u][0] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const __m256 scale = _mm256_loadu_ps(dg + b * GROUP + 8 * h), low = _mm256_loadu_ps(mg + b * GROUP + 8 * h);
        const uint8_t* cb = c + b * 256 + 8 * h;
        const int64_t k0 = b * BLOCK;
        for (int j = 0; j < 16; ++j) {
          const __m256i v = widen_u8(cb + j * 16);
          const __m256 w_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, nibble)), scale, low);
          const __m256 w_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), scale, low);
          for (int i = 0; i < MB; ++i) {
            __m256& lo_sum = acc[i][(2 * j) % CH][0];
            __m256& hi_sum = acc[i][(2 * j + 1) % CH][0];
            lo_sum = _mm256_fmadd_ps(w_lo, _mm256_set1_ps(xr[i * K + k0 + j]), lo_sum);
            hi_sum = _mm256_fmadd_ps(w_hi, _mm256_set1_ps(xr[i * K + k0 + 16 + j]), hi_sum);
          }
        }
      }
      const __m256 add = bias ? _mm256_loadu_ps(bias + g * GROUP + 8 * h) : _mm256_setzero_ps();
      for (int i = 0; i < MB; ++i) {
        __m256 sum = acc[i][0][0];
        for (int u = 1; u < CH; ++u) sum = _mm256_add_ps(sum, acc[i][u][0]);
        _mm256_storeu_ps(y + (i0 + i) * N + g * GROUP + 8 * h, _mm256_add_ps(sum, add));
      }
    }
  }
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
  constexpr int CH = 1;
  __m512 acc[MB][CH];
  zero_rows<MB, CH>(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 scale = _mm512_loadu_ps(dg + b * GROUP);
    const int8_t* cb = c + b * 512;
    const int64_t k0 = b * BLOCK;
    for (int t = 0; t < 32; ++t) {
      const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + t * 16)));
      const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(v), scale);
      for (int i = 0; i < MB; ++i) acc[i][t % CH] = _mm512_fmadd_ps(w, _mm512_set1_ps(xr[i * K + k0 + t]), acc[i][t % CH]);
    }
  }
  store_rows<MB, CH>(acc, bias, g, i0, N, y);
#elif defined(FLASHMM_AVX2)
  __m256 acc[MB][1][2];
  zero_rows<MB, 1>(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256 scale[2] = {_mm256_loadu_ps(dg + b * GROUP), _mm256_loadu_ps(dg + b * GROUP + 8)};
    const int8_t* cb = c + b * 512;
    const int64_t k0 = b * BLOCK;
    for (int t = 0; t < 32; ++t)
      for (int h = 0; h < 2; ++h) {
        const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(widen_i8(cb + t * 16 + 8 * h)), scale[h]);
        for (int i = 0; i < MB; ++i) acc[i][0][h] = _mm256_fmadd_ps(w, _mm256_set1_ps(xr[i * K + k0 + t]), acc[i][0][h]);
      }
  }
  store_rows<MB, 1>(acc, bias, g, i0, N, y);
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

// bf16 weights (a drafter's, which only proposes tokens): W[n, k] = the bf16 codes[g, k, l] widened to fp32
// (exact), codes [N / 16, K, 16] int16 (bf16 bits), any K; x stays fp32
template <int MB>
void group_rows_bf16(const float* x, const uint8_t* codes, const float*, const float*, int64_t g, int64_t i0,
                     int64_t K, int64_t N, const float* bias, float* y) {
  const uint16_t* c = reinterpret_cast<const uint16_t*>(codes) + g * K * GROUP;
  const float* xr = x + i0 * K;
#if defined(__AVX512F__)
  constexpr int CH = chains<MB>();
  __m512 acc[MB][CH];
  zero_rows<MB, CH>(acc);
  int64_t k = 0;
  for (; k + CH <= K; k += CH)
    for (int u = 0; u < CH; ++u) {
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (k + u) * GROUP)));
      const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      for (int i = 0; i < MB; ++i) acc[i][u] = _mm512_fmadd_ps(w, _mm512_set1_ps(xr[i * K + k + u]), acc[i][u]);
    }
  for (; k < K; ++k) {
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k * GROUP)));
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    for (int i = 0; i < MB; ++i) acc[i][0] = _mm512_fmadd_ps(w, _mm512_set1_ps(xr[i * K + k]), acc[i][0]);
  }
  store_rows<MB, CH>(acc, bias, g, i0, N, y);
#elif defined(FLASHMM_AVX2)
  constexpr int CH = chains2<MB>();
  __m256 acc[MB][CH][2];
  zero_rows<MB, CH>(acc);
  int64_t k = 0;
  for (; k + CH <= K; k += CH)
    for (int u = 0; u < CH; ++u)
      for (int h = 0; h < 2; ++h) {
        const __m256 w = widen_bf16(c + (k + u) * GROUP + 8 * h);
        for (int i = 0; i < MB; ++i) acc[i][u][h] = _mm256_fmadd_ps(w, _mm256_set1_ps(xr[i * K + k + u]), acc[i][u][h]);
      }
  for (; k < K; ++k)
    for (int h = 0; h < 2; ++h) {
      const __m256 w = widen_bf16(c + k * GROUP + 8 * h);
      for (int i = 0; i < MB; ++i) acc[i][0][h] = _mm256_fmadd_ps(w, _mm256_set1_ps(xr[i * K + k]), acc[i][0][h]);
    }
  store_rows<MB, CH>(acc, bias, g, i0, N, y);
#else
  float acc[MB][GROUP] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int l = 0; l < GROUP; ++l) {
      uint32_t bits = static_cast<uint32_t>(c[k * GROUP + l]) << 16;
      float w;
      std::memcpy(&w, &bits, sizeof w);
      for (int i = 0; i < MB; ++i) acc[i][l] += w * xr[i * K + k];
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
constexpr std::array<GroupRows, sizeof...(MB)> table_bf16(std::integer_sequence<int, MB...>) {
  return {&group_rows_bf16<MB + 1>...};
}

template <int... MB>
constexpr std::array<GroupRows, sizeof...(MB)> table8(std::integer_sequence<int, MB...>) {
  return {&group_rows8<MB + 1>...};
}

// bias's data (checked: fp32 [N]) or nullptr
const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: fp32 [N]");
  return bias->data_ptr<float>();
}

// y [M, N] = every group of 16 rows of W (in parallel) times every TILE rows of x, by kernels[rows - 1]
template <size_t T>
torch::Tensor run_groups(const std::array<GroupRows, T>& kernels, const torch::Tensor& x, const torch::Tensor& codes,
                         const float* d, const float* m, int64_t groups, const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), N = groups * GROUP;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t i = 0; i < M; i += TILE)
        kernels[std::min<int64_t>(TILE, M - i) - 1](xp, cp, d, m, g, i, K, N, bias, yp);
  });
  return y;
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
  const int64_t K = x.size(1), groups = codes.size(0), N = groups * GROUP;
  TORCH_CHECK(codes.size(1) * BLOCK == K, "codes cover ", codes.size(1) * BLOCK, " columns, x has ", K);
  TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.numel() == N * K / BLOCK &&
              (eight || (m.scalar_type() == torch::kFloat && m.is_contiguous() && m.numel() == N * K / BLOCK)),
              "d, m: fp32 [N / 16, K / 32, 16]");
  static const auto kernels4 = table(std::make_integer_sequence<int, TILE>{});
  static const auto kernels8 = table8(std::make_integer_sequence<int, TILE>{});
  return run_groups(eight ? kernels8 : kernels4, x, codes, d.data_ptr<float>(), eight ? nullptr : m.data_ptr<float>(),
                    groups, bias_data(bias, N));
}

// x [M, K] fp32 times a bf16 weight [N, K] held as codes [N / 16, K, 16] int16 (its bf16 bits), plus bias: a few
// rows at a fraction of oneDNN's per-call cost on these small matrices (a drafter's layers)
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor codes, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: a contiguous fp32 [M, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == torch::kShort && codes.is_contiguous() && codes.size(2) == GROUP &&
              codes.size(1) == x.size(1), "codes: int16 [N / 16, K, 16] for x's K = ", x.size(1));
  const int64_t groups = codes.size(0), N = groups * GROUP;
  static const auto kernels = table_bf16(std::make_integer_sequence<int, TILE>{});
  return run_groups(kernels, x, codes, nullptr, nullptr, groups, bias_data(bias, N));
}

// The small steps between a decode step's matmuls, one pass each (torch's rms_norm runs as six ops on a CPU,
// ~25 us for one 576-wide row, against a few here): x [M, D] fp32 contiguous.
namespace {

void rms_norm_rows(const float* x, const float* weight, double eps, int64_t M, int64_t D, float* out) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = x + i * D;
      float sum = 0.f;
      for (int64_t k = 0; k < D; ++k) sum += row[k] * row[k];
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t k = 0; k < D; ++k) out[i * D + k] = row[k] * scale * weight[k];
    }
  });
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: a contiguous fp32 [M, D]");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight: fp32 [D]");
}

}  // namespace

// RMSNorm of each row: x / sqrt(mean(x^2) + eps) * weight
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), eps, x.size(0), x.size(1), out.data_ptr<float>());
  return out;
}

// (x + delta, its RMSNorm): a residual step and the norm that follows it
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight,
                                                      double eps) {
  check_rows(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == torch::kFloat && delta.is_contiguous(),
              "delta: a contiguous fp32 tensor shaped as x");
  auto sum = torch::empty_like(x);
  const float* a = x.data_ptr<float>();
  const float* b = delta.data_ptr<float>();
  float* s = sum.data_ptr<float>();
  for (int64_t k = 0, n = x.numel(); k < n; ++k) s[k] = a[k] + b[k];
  auto out = torch::empty_like(x);
  rms_norm_rows(s, weight.data_ptr<float>(), eps, x.size(0), x.size(1), out.data_ptr<float>());
  return {sum, out};
}

// silu(gate) * up for gated = [gate | up] [M, 2F] → [M, F]: one row in a plain loop, more with ATen's vectorised
// silu (std::exp one element at a time cost 21 us for 5 rows of SmolLM2's 1,536, ATen's ops 10)
torch::Tensor silu_mul(torch::Tensor gated) {
  TORCH_CHECK(gated.dim() == 2 && gated.scalar_type() == torch::kFloat && gated.is_contiguous() && gated.size(1) % 2 == 0,
              "gated: a contiguous fp32 [M, 2F]");
  const int64_t M = gated.size(0), F = gated.size(1) / 2;
  if (M > 1) return at::silu(gated.narrow(1, 0, F)).mul_(gated.narrow(1, F, F));
  auto out = torch::empty({M, F}, gated.options());
  const float* g = gated.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t k = 0; k < F; ++k) o[k] = g[k] / (1.f + std::exp(-g[k])) * g[F + k];
  return out;
}

// Rotary embeddings of one step's q and k, and its keys and values written into the cache:
// qkv [B * n, (H + 2 KV) * D] (q heads, k heads, v heads), cos / sin [B, n, D] (each half the same as the model's
// rotary_emb gives them) → q [B, H, n, D] rotated; rotated k and v written to keys / values [B, KV, capacity, D]
// (contiguous) at rows length .. length + n. out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
torch::Tensor rope_append(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads,
                          std::tuple<torch::Tensor, torch::Tensor> room, int64_t length) {
  auto keys = std::get<0>(room), values = std::get<1>(room);
  TORCH_CHECK(cos.dim() == 3 && cos.scalar_type() == torch::kFloat && sin.sizes() == cos.sizes(),
              "cos, sin: fp32 [B, n, D]");
  const int64_t B = cos.size(0), n = cos.size(1), D = cos.size(2), half = D / 2, width = (heads + 2 * kv_heads) * D;
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat && qkv.is_contiguous() && qkv.size(0) == B * n &&
              qkv.size(1) == width, "qkv: a contiguous fp32 [B * n, (H + 2 KV) * D]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 4 && keys.size(0) == B &&
              keys.size(1) == kv_heads && keys.size(3) == D && keys.size(2) >= length + n && values.sizes() == keys.sizes(),
              "keys, values: contiguous [B, KV, capacity >= length + n, D]");
  auto c = cos.contiguous(), s = sin.contiguous();
  auto q = torch::empty({B, heads, n, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const int64_t capacity = keys.size(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < n; ++t) {
      const float* row = src + (b * n + t) * width;
      const float* ct = cp + (b * n + t) * D;
      const float* st = sp + (b * n + t) * D;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const float* x = row + h * D;
        float* out = h < heads ? qp + ((b * heads + h) * n + t) * D
                               : kp + ((b * kv_heads + h - heads) * capacity + length + t) * D;
        for (int64_t k = 0; k < half; ++k) {
          const float a = x[k] * ct[k], r = x[k + half] * st[k];
          out[k] = a - r;
          const float a2 = x[k + half] * ct[k + half], r2 = x[k] * st[k + half];
          out[k + half] = a2 + r2;
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h)
        std::copy(row + (heads + kv_heads + h) * D, row + (heads + kv_heads + h + 1) * D,
                  vp + ((b * kv_heads + h) * capacity + length + t) * D);
    }
  return q;
}

// A decode step's decoder layers in one call (Llama-family layers whose four matmuls multiply from block codes, no
// q / k norms), doing what FusedDecoder's layer loop does, in its order and with its kernels and attention call, so
// its sums are the same bit for bit; the ~20 Python-level calls a layer costs (~1 ms of SmolLM2's ~6.5 ms
// one-token step on the 2-core EPYC) become one call a step. Each layer's weights, per FIELDS entries: qkv
// (codes, d, m, bias), o (codes, d, m, bias), the post-attention norm's weight, gate|up (codes, d, m), down
// (codes, d, m), the next norm's weight (the next layer's input norm, the final norm after the last); an absent
// bias or 8-bit m is an empty tensor. eps: each layer's post-attention and next norm's epsilon.
namespace {

constexpr size_t FIELDS = 16;

c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  return t.defined() && t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

torch::Tensor product(const torch::Tensor& x, const torch::Tensor* w, const torch::Tensor& bias) {
  return block_linear(x, w[0], w[1], w[2], present(bias));
}

// flashmm.targets.fused_attention.attend: q [B, H, n, D] over keys / values [B, KV, S, D] under an additive mask
// [B or 1, 1, n, S] (or none), a verification step's grouped query heads folded onto their kv head for
// 2 <= n <= fold_max (its FOLD_MAX)
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                     const c10::optional<torch::Tensor>& mask, bool causal, double scale, int64_t fold_max) {
  const int64_t batch = q.size(0), heads = q.size(1), n = q.size(2), dim = q.size(3), kv_heads = keys.size(1);
  if (heads == kv_heads || causal || !mask.has_value() || n < 2 || n > fold_max)
    return at::scaled_dot_product_attention(q, keys, values, mask, 0.0, causal, scale, heads != kv_heads);
  const int64_t group = heads / kv_heads, slots = keys.size(2);
  auto m = mask->reshape({-1, 1, n, slots});
  const int64_t rows = m.size(0);
  auto folded = q.reshape({batch, kv_heads, group * n, dim});
  m = m.unsqueeze(2).expand({rows, 1, group, n, slots}).reshape({rows, 1, group * n, slots});
  return at::scaled_dot_product_attention(folded, keys, values, m, 0.0, false, scale).view({batch, heads, n, dim});
}

}  // namespace

struct LayerStack {
  std::vector<torch::Tensor> weights;
  std::vector<double> eps;
  int64_t heads, kv_heads, fold_max;
  double scaling;

  LayerStack(std::vector<torch::Tensor> weights, std::vector<double> eps, int64_t heads, int64_t kv_heads,
             double scaling, int64_t fold_max)
      : weights(std::move(weights)), eps(std::move(eps)), heads(heads), kv_heads(kv_heads), fold_max(fold_max),
        scaling(scaling) {
    TORCH_CHECK(this->weights.size() % FIELDS == 0 && this->eps.size() * FIELDS == 2 * this->weights.size(),
                "weights: ", FIELDS, " tensors a layer, eps: 2 a layer");
  }

  // x, normed [B * n, width] (normed: x through the first layer's input norm); rooms: each layer's (keys, values)
  // [B, KV, capacity, D], its first `length` rows cached; cos / sin [B, n, D] → [x, normed after the last layer
  // (the final norm), each layer's keys and values (its room's first length + n rows), and with keep_hidden each
  // layer's output x]
  std::vector<torch::Tensor> run(torch::Tensor x, torch::Tensor normed, std::vector<torch::Tensor> rooms, int64_t length,
                                 torch::Tensor cos, torch::Tensor sin, c10::optional<torch::Tensor> mask, bool causal,
                                 bool keep_hidden) {
    const size_t layers = weights.size() / FIELDS;
    TORCH_CHECK(rooms.size() == 2 * layers, "rooms: keys and values for each of the ", layers, " layers");
    const int64_t batch = cos.size(0), n = cos.size(1), dim = cos.size(2);
    std::vector<torch::Tensor> out(2 + 2 * layers);
    for (size_t l = 0; l < layers; ++l) {
      const torch::Tensor* w = weights.data() + l * FIELDS;
      auto qkv = product(normed, w, w[3]);
      auto q = rope_append(qkv, cos, sin, heads, kv_heads, {rooms[2 * l], rooms[2 * l + 1]}, length);
      auto keys = rooms[2 * l].narrow(2, 0, length + n), values = rooms[2 * l + 1].narrow(2, 0, length + n);
      out[2 + 2 * l] = keys;
      out[3 + 2 * l] = values;
      auto attended = attend(q, keys, values, mask, causal, scaling, fold_max).transpose(1, 2).reshape({batch * n, heads * dim});
      auto after = add_rms_norm(x, product(attended, w + 4, w[7]), w[8], eps[2 * l]);
      auto gated = silu_mul(product(std::get<1>(after), w + 9, torch::Tensor()));
      auto next = add_rms_norm(std::get<0>(after), product(gated, w + 12, torch::Tensor()), w[15], eps[2 * l + 1]);
      x = std::get<0>(next);
      normed = std::get<1>(next);
      if (keep_hidden) out.push_back(x);
    }
    out[0] = x;
    out[1] = normed;
    return out;
  }
};

// the vector path this build compiled (the tests build the AVX2 one on AVX-512 machines too)
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(FLASHMM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("isa", &isa, "the vector path this build compiled: avx512, avx2 or scalar");
  module.def("rope_append", &rope_append, "rotary q and k of a step, its keys and values written into the cache");
  module.def("bf16_linear", &bf16_linear, "x [M, K] fp32 times a bf16 weight [N, K] (codes [N / 16, K, 16]), plus bias");
  module.def("rms_norm", &rms_norm, "RMSNorm of each row of x [M, D]");
  module.def("add_rms_norm", &add_rms_norm, "(x + delta, its RMSNorm)");
  module.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] [M, 2F]");
  // module_local: the AVX2 build the tests load beside this one registers its own
  pybind11::class_<LayerStack>(module, "LayerStack", pybind11::module_local())
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<double>, int64_t, int64_t, double, int64_t>())
      .def("run", &LayerStack::run, "a decode step's decoder layers: [x, normed, each layer's keys and values, each layer's x with keep_hidden]");
  module.def("block_linear", &block_linear, "x [M, K] fp32 times a 4-bit or 8-bit block weight [N, K], plus bias");
}
