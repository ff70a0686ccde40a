// AVX-512 VNNI kernel: a register holds one panel's 16 columns as int32 lanes. The low or the high nibbles of a
// 64-byte chunk are those columns' next four weights, so one vpdpbusd against four activation bytes broadcast adds
// them to each column's exact block dot. Rows of a pass share every unpacked chunk.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "q4gemm.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")

namespace {

inline __m512i broadcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Rows [r0, r0 + MR) times NC consecutive panels from `panel` (columns from n0). Up to six rows of two panels keep
// the block dots and the superblock partials in registers. Block by block it also prefetches an even share of
// `ahead` (the bytes the next call will read from memory), so that the loads meet the cache and the
// stream stays ahead of the arithmetic.
template <int MR, int NC>
void panel_rows(const QuantizedRows& a, int64_t r0, const uint8_t* panel, const Q4Layout& l, float* y, int64_t ldy,
                bool stream, int64_t n0, Window ahead) {
  const int64_t nb = l.blocks(), kb = nb * kBlock, stride = l.panel_bytes(), nibbles = l.nibble_bytes();
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[MR][NC];  // touched once a superblock: the compiler may keep it in memory when registers run short
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < a.supers; ++s) {
    __m512 t[MR][NC];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NC; ++c) t[r][c] = _mm512_setzero_ps();
    const int64_t end = std::min<int64_t>(nb, (s + 1) * kSuper);
    for (int64_t b = s * kSuper; b < end; ++b) {
      ahead.prefetch(b, nb);
      __m512i dot[MR][NC];
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) dot[r][c] = _mm512_setzero_si512();
      const int8_t* xb = a.q + r0 * kb + b * kBlock;
      for (int h = 0; h < 4; ++h) {
        // every chain's low-nibble product, then every chain's high one: two products in a row on one chain would
        // wait out vpdpbusd's latency
        __m512i lo[NC], hi[NC];
        for (int c = 0; c < NC; ++c) {
          const __m512i chunk = _mm512_loadu_si512(panel + c * stride + b * (kPanel * kBlock / 2) + h * 64);
          lo[c] = _mm512_and_si512(chunk, low);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low);
        }
        for (int r = 0; r < MR; ++r) {
          const __m512i x = broadcast4(xb + r * kb + 8 * h);
          for (int c = 0; c < NC; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], lo[c], x);
        }
        for (int r = 0; r < MR; ++r) {
          const __m512i x = broadcast4(xb + r * kb + 8 * h + 4);
          for (int c = 0; c < NC; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], hi[c], x);
        }
      }
      for (int c = 0; c < NC; ++c) {
        const __m512 dw = half16(panel + c * stride + nibbles + b * kPanel * 2);
        for (int r = 0; r < MR; ++r) t[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), dw, t[r][c]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 d = _mm512_set1_ps(a.d[(r0 + r) * a.supers + s]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(t[r][c], d, acc[r][c]);
    }
  }
  __m512 o[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) o[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b)
    for (int c = 0; c < NC; ++c) {
      const uint8_t* scales = panel + c * stride + nibbles;
      const __m512 off = l.offsets ? half16(scales + (nb + b) * kPanel * 2)
                                   : _mm512_mul_ps(half16(scales + b * kPanel * 2), _mm512_set1_ps(-8.0f));
      for (int r = 0; r < MR; ++r) o[r][c] = _mm512_fmadd_ps(off, _mm512_set1_ps(a.dsum[(r0 + r) * nb + b]), o[r][c]);
    }
  for (int c = 0; c < NC; ++c) {
    const int64_t n = n0 + c * kPanel, cols = std::min<int64_t>(kPanel, l.n - n);
    const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
    for (int r = 0; r < MR; ++r) {
      float* out = y + (r0 + r) * ldy + n;
      if (stream && cols == kPanel) _mm512_stream_ps(out, _mm512_add_ps(acc[r][c], o[r][c]));
      else _mm512_mask_storeu_ps(out, keep, _mm512_add_ps(acc[r][c], o[r][c]));
    }
  }
}

// Rows [r0, r0 + MR) times a group of g panels: a single row takes the group at once (four independent chains to
// cover vpdpbusd's latency), more rows two panels at a time.
template <int MR>
void group_rows(const QuantizedRows& a, int64_t r0, const uint8_t* panel, int64_t g, const Q4Layout& l, float* y,
                int64_t ldy, bool stream, int64_t n0, Window ahead) {
  if (MR == 1) {
    switch (g) {
      case 4: return panel_rows<1, 4>(a, r0, panel, l, y, ldy, stream, n0, ahead);
      case 3: return panel_rows<1, 3>(a, r0, panel, l, y, ldy, stream, n0, ahead);
      case 2: return panel_rows<1, 2>(a, r0, panel, l, y, ldy, stream, n0, ahead);
      default: return panel_rows<1, 1>(a, r0, panel, l, y, ldy, stream, n0, ahead);
    }
  }
  const int64_t calls = (g + 1) / 2;
  for (int64_t c = 0; c < g; c += 2) {
    const Window share = ahead.part(c / 2, calls);
    if (g - c >= 2) panel_rows<MR, 2>(a, r0, panel + c * l.panel_bytes(), l, y, ldy, stream, n0 + c * kPanel, share);
    else panel_rows<MR, 1>(a, r0, panel + c * l.panel_bytes(), l, y, ldy, stream, n0 + c * kPanel, share);
  }
}

constexpr int64_t kMaxRows = 6;  // rows a chunk multiplies at once: the registers' limit

#include "q4gemm_panels.inc"

}  // namespace

void gemm_panels_avx512vnni(const QuantizedRows& a, int64_t m, const uint8_t* w, const Q4Layout& l, int64_t p0,
                            int64_t p1, float* y, int64_t ldy, bool stream, Window after) {
  panel_groups<kMaxRows>(m, w, l, p0, p1, after,
                         [&](auto mr, int64_t r0, const uint8_t* panel, int64_t g, int64_t n0, Window ahead) {
                           group_rows<decltype(mr)::value>(a, r0, panel, g, l, y, ldy, stream, n0, ahead);
                         });
  if (stream) _mm_sfence();  // the streamed lines reach memory before whoever reads y next
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
