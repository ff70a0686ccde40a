// AVX-512 VNNI kernel (512-bit): one register holds a column pair, column 2p in lanes 0-7 and 2p+1 in lanes 8-15,
// so one vpdpbusd gives both columns' exact int32 lane sums for a block and a row. A pair's packed 32 bytes,
// broadcast to both halves and shifted by 0 or 4 bits per half, are its two columns' weights.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "q4gemm.h"

namespace specc {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")

namespace {

#include "q4gemm_tile.inc"

// Rows [m, m + MR) of one tile, column pairs [p0, p0 + NP): superblock partial sums in registers, lanes in memory.
// With Offsets it also sums the offsets of all 8 columns into off [MR][8] (in the block loop, where their chain of
// fmas hides behind the dot products), which the call for the other pairs then reads. Four rows of two pairs keep
// every operand in registers and unpack each weight once per four rows.
template <int MR, int NP, bool Offsets>
inline void tile_rows(const QuantizedRows& a, int64_t m, const uint8_t* tile, const TileScales& sc, const Q4Layout& l,
                      int p0, float (*off)[kTile], float* y, int64_t ldy, int64_t n0) {
  const int64_t nb = l.blocks(), tbb = l.tile_block_bytes();
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512i pick[NP];
  for (int p = 0; p < NP; ++p)
    pick[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * (p0 + p)), _mm256_set1_epi32(2 * (p0 + p) + 1), 1);
  alignas(64) float lanes[MR][NP][16] = {};
  __m256 offsets[MR];
  for (int r = 0; r < MR; ++r) offsets[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < a.supers; ++s) {
    __m512 part[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NP; ++p) part[r][p] = _mm512_setzero_ps();
    const int64_t end = std::min<int64_t>(nb, (s + 1) * kSuper);
    for (int64_t b = s * kSuper; b < end; ++b) {
      const uint8_t* tb = tile + b * tbb;
      const __m512 s8 = _mm512_castps256_ps512(_mm256_loadu_ps(sc.scale.data() + b * kTile));
      __m512i w[NP];
      __m512 dw[NP];
      for (int p = 0; p < NP; ++p) {
        const __m512i packed =
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + (p0 + p) * kBlock)));
        w[p] = _mm512_and_si512(_mm512_srlv_epi16(packed, shifts), low);
        dw[p] = _mm512_permutexvar_ps(pick[p], s8);
      }
      for (int r = 0; r < MR; ++r) {
        const int64_t row = (m + r) * nb + b;
        const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + row * kBlock)));
        for (int p = 0; p < NP; ++p)
          part[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[p], x)),
                                       dw[p], part[r][p]);
        if (Offsets)
          offsets[r] = _mm256_fmadd_ps(_mm256_loadu_ps(sc.offset.data() + b * kTile), _mm256_broadcast_ss(a.dsum + row),
                                       offsets[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 d = _mm512_set1_ps(a.d[(m + r) * a.supers + s]);
      for (int p = 0; p < NP; ++p)
        _mm512_store_ps(lanes[r][p], _mm512_fmadd_ps(part[r][p], d, _mm512_load_ps(lanes[r][p])));
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (Offsets) _mm256_storeu_ps(off[r], offsets[r]);
    for (int p = 0; p < NP; ++p) {
      const int c = 2 * (p0 + p);
      const __m512 v = _mm512_load_ps(lanes[r][p]);
      if (n0 + c < l.n) y[(m + r) * ldy + n0 + c] = hsum8(_mm512_castps512_ps256(v)) + off[r][c];
      if (n0 + c + 1 < l.n) y[(m + r) * ldy + n0 + c + 1] = hsum8(_mm512_extractf32x8_ps(v, 1)) + off[r][c + 1];
    }
  }
}

// Rows [m, m + MR) of one tile: up to two rows all four pairs at once, more in two halves (pairs 0-1 with the
// offsets, then pairs 2-3) to stay within the registers.
template <int MR>
inline void tile_rows(const QuantizedRows& a, int64_t m, const uint8_t* tile, const TileScales& sc, const Q4Layout& l,
                      float* y, int64_t ldy, int64_t n0) {
  float off[MR][kTile];
  if (MR <= 2) {
    tile_rows<MR, 4, true>(a, m, tile, sc, l, 0, off, y, ldy, n0);
    return;
  }
  tile_rows<MR, 2, true>(a, m, tile, sc, l, 0, off, y, ldy, n0);
  tile_rows<MR, 2, false>(a, m, tile, sc, l, 2, off, y, ldy, n0);
}

}  // namespace

void gemm_tiles_avx512vnni(const QuantizedRows& a, int64_t m0, int64_t m1, const uint8_t* w, const Q4Layout& l,
                           int64_t t0, int64_t t1, float* y, int64_t ldy) {
  TileScales sc(l.blocks());
  const int64_t tile_bytes = l.tile_bytes();
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * tile_bytes;
    if (t + kPrefetchTiles < t1)
      for (int64_t off = 0; off < tile_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(tile + kPrefetchTiles * tile_bytes + off), _MM_HINT_T0);
    sc.load(tile, l);
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) tile_rows<4>(a, m, tile, sc, l, y, ldy, t * kTile);
    if (m1 - m == 3) tile_rows<3>(a, m, tile, sc, l, y, ldy, t * kTile);
    if (m1 - m == 2) tile_rows<2>(a, m, tile, sc, l, y, ldy, t * kTile);
    if (m1 - m == 1) tile_rows<1>(a, m, tile, sc, l, y, ldy, t * kTile);
  }
}

#pragma GCC pop_options

}  // namespace specc

#endif  // __x86_64__
