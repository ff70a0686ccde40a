// The scalar reference: the definition every ISA's kernel must reproduce bit for bit (q4gemm.h).
#include <algorithm>
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

void quantize_rows(const float* x, int64_t m0, int64_t m1, int64_t k, int64_t blocks, int8_t* q, float* d, float* dsum) {
  const int64_t supers = (blocks + kSuper - 1) / kSuper;
  for (int64_t r = m0; r < m1; ++r) {
    const float* xr = x + r * k;
    for (int64_t s = 0; s < supers; ++s) {
      const int64_t lo = s * kSuper * kBlock, hi = std::min<int64_t>(lo + kSuper * kBlock, blocks * kBlock);
      float amax = 0.0f;
      for (int64_t c = lo; c < std::min(hi, k); ++c) amax = std::fmax(amax, std::fabs(xr[c]));
      const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qs = q + r * blocks * kBlock;
      for (int64_t c = lo; c < hi; ++c) {
        const float v = std::nearbyint((c < k ? xr[c] : 0.0f) * inv);
        qs[c] = static_cast<int8_t>(v > 127.0f ? 127 : (v < -127.0f ? -127 : v));
      }
      d[r * supers + s] = scale;
      for (int64_t b = lo / kBlock; b < hi / kBlock; ++b) {
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) sum += qs[b * kBlock + i];
        dsum[r * blocks + b] = scale * static_cast<float>(sum);
      }
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
        const int shift = (c % 2) * 4;
        float lane[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0}, offset = 0.0f;
        for (int64_t s = 0; s < a.supers; ++s) {
          float part[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
          for (int64_t b = s * kSuper; b < std::min<int64_t>(nb, (s + 1) * kSuper); ++b) {
            const uint8_t* tb = tile + b * tbb;
            const uint8_t* pair = tb + (c / 2) * kBlock;
            const uint16_t* halves = reinterpret_cast<const uint16_t*>(tb + kTile * kBlock / 2);
            const float dw = half_to_float(halves[c]);
            const float off = l.offsets ? half_to_float(halves[kTile + c]) : -8.0f * dw;
            const int8_t* xb = qx + b * kBlock;
            for (int j = 0; j < kLanes; ++j) {
              int32_t dot = 0;
              for (int i = 4 * j; i < 4 * j + 4; ++i) dot += ((pair[i] >> shift) & 15) * xb[i];
              part[j] = std::fma(static_cast<float>(dot), dw, part[j]);
            }
            offset = std::fma(off, a.dsum[m * nb + b], offset);
          }
          for (int j = 0; j < kLanes; ++j) lane[j] = std::fma(part[j], a.d[m * a.supers + s], lane[j]);
        }
        y[m * ldy + n] =
            (((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]))) + offset;
      }
    }
  }
}

}  // namespace specc
