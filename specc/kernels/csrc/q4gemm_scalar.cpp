// The scalar reference: the definition every ISA's kernel must reproduce bit for bit (q4gemm.h).
#include <cmath>
#include <cstring>

#include "q4gemm.h"

namespace specc {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    exp = 113;
    while (!(mant & 0x400)) { mant <<= 1; --exp; }
    bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void quantize_rows(const float* x, int64_t m, int64_t k, int64_t blocks, int8_t* q, float* d, float* dsum) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    for (int64_t b = 0; b < blocks; ++b) {
      float v[kBlock];
      for (int i = 0; i < kBlock; ++i) {
        const int64_t c = b * kBlock + i;
        v[i] = c < k ? xr[c] : 0.0f;
      }
      float amax = 0.0f;
      for (float t : v) amax = std::fmax(amax, std::fabs(t));
      const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qb = q + (r * blocks + b) * kBlock;
      for (int i = 0; i < kBlock; ++i) {
        const float s = std::nearbyint(v[i] * inv);
        qb[i] = static_cast<int8_t>(s > 127.0f ? 127 : (s < -127.0f ? -127 : s));
      }
      d[r * blocks + b] = scale;
      float* ds = dsum + (r * blocks + b) * kLanes;
      for (int j = 0; j < kLanes; ++j)
        ds[j] = scale * static_cast<float>(qb[4 * j] + qb[4 * j + 1] + qb[4 * j + 2] + qb[4 * j + 3]);
    }
  }
}

void gemm_tiles_scalar(const QuantizedRows& a, int64_t m0, int64_t m1, const uint8_t* w, const Q4Layout& l,
                       int64_t t0, int64_t t1, float* y, int64_t ldy) {
  const int64_t nb = l.blocks(), tbb = l.tile_block_bytes();
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * l.tile_bytes();
    for (int64_t m = m0; m < m1; ++m) {
      const int8_t* qx = a.q + m * nb * kBlock;
      for (int c = 0; c < kTile; ++c) {
        const int64_t n = t * kTile + c;
        if (n >= l.n) break;
        float lane[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* tb = tile + b * tbb;
          const uint8_t* pair = tb + (c / 2) * kBlock;
          const int shift = (c % 2) * 4;
          const uint16_t* halves = reinterpret_cast<const uint16_t*>(tb + kTile * kBlock / 2);
          const float dw = half_to_float(halves[c]);
          const float off = l.offsets ? half_to_float(halves[kTile + c]) : -8.0f * dw;
          const float dwx = dw * a.d[m * nb + b];
          const int8_t* xb = qx + b * kBlock;
          const float* ds = a.dsum + (m * nb + b) * kLanes;
          for (int j = 0; j < kLanes; ++j) {
            int32_t dot = 0;
            for (int i = 4 * j; i < 4 * j + 4; ++i) dot += ((pair[i] >> shift) & 15) * xb[i];
            lane[j] = std::fma(static_cast<float>(dot), dwx, lane[j]);
            lane[j] = std::fma(off, ds[j], lane[j]);
          }
        }
        y[m * ldy + n] = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
      }
    }
  }
}

}  // namespace specc
