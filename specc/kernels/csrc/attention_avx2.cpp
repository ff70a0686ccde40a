// CacheAttention on AVX2: two 256-bit registers are the 16 lanes attention.h defines (lanes 0-7 and 8-15).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "attention.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

#include "attention_x86.inc"

struct Lanes256x2 {
  struct reg {
    __m256 lo, hi;
  };
  static reg zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static reg set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static reg load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(float* p, reg a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
  }
  static reg mul(reg a, reg b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static reg add(reg a, reg b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static reg sub(reg a, reg b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static reg div(reg a, reg b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  static reg fma(reg a, reg b, reg c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static reg max(reg a, reg b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  static reg round(reg a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
  }
  static __m256 pow2(__m256 n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static reg pow2(reg n) { return {pow2(n.lo), pow2(n.hi)}; }
  static __m256 keep8(uint32_t bits, __m256 a) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane), lane);
    return _mm256_and_ps(a, _mm256_castsi256_ps(set));
  }
  static reg keep(uint32_t bits, reg a) { return {keep8(bits & 0xff, a.lo), keep8(bits >> 8, a.hi)}; }
  static float hsum(reg a) { return hsum_tree8(_mm256_add_ps(a.lo, a.hi)); }
  // The 16 trees at once: lanes i and i + 8 are a register's two halves; each later step adds the lanes the tree
  // pairs (i and i + 4, i + 2, i + 1) of two registers side by side, inputs taken in the order that leaves lane j
  // with register j's sum.
  static reg hsums(const reg* d) {
    constexpr int order[kLanes] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
    __m256 t[kLanes], u[8], v[4], w[2];
    for (int k = 0; k < kLanes; ++k) t[k] = _mm256_add_ps(d[order[k]].lo, d[order[k]].hi);
    for (int m = 0; m < 8; ++m)
      u[m] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * m], t[2 * m + 1], 0x20),
                           _mm256_permute2f128_ps(t[2 * m], t[2 * m + 1], 0x31));
    for (int m = 0; m < 4; ++m)
      v[m] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * m], u[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(u[2 * m], u[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 2; ++m)
      w[m] = _mm256_add_ps(_mm256_shuffle_ps(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm256_shuffle_ps(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return {w[0], w[1]};
  }
  static constexpr bool kWideRegisterFile = false;
  static uint32_t nonzero16(const uint8_t* p) { return nonzero_bytes16(p); }
};

#include "attention_impl.inc"

}  // namespace

void attend_avx2(const AttentionArgs& a, int64_t b, int64_t hkv, int64_t i0, int64_t i1, AttentionScratch& s) {
  attend<Lanes256x2>(a, b, hkv, i0, i1, s);
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
