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

namespace {

// Column c's q (0..15) for input i of a block whose nibbles start at `nibbles` (q4gemm.h's panel layout).
inline int weight_q(const uint8_t* nibbles, int c, int i) {
  const uint8_t byte = nibbles[(i / 8) * 64 + 4 * c + i % 4];
  return (i % 8) < 4 ? byte & 15 : byte >> 4;
}

}  // namespace

void gemm_panels_scalar(const QuantizedRows& a, int64_t m, const uint8_t* w, const Q4Layout& l, int64_t p0, int64_t p1,
                        float* y, int64_t ldy, bool /*stream*/, Window /*after*/) {
  const int64_t nb = l.blocks();
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = w + p * l.panel_bytes();
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(panel + l.nibble_bytes());
    const uint16_t* offsets = scales + nb * kPanel;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* qx = a.q + r * nb * kBlock;
      for (int c = 0; c < kPanel && p * kPanel + c < l.n; ++c) {
        float acc = 0.0f, o = 0.0f;
        for (int64_t s = 0; s < a.supers; ++s) {
          float t = 0.0f;
          for (int64_t b = s * kSuper; b < std::min<int64_t>(nb, (s + 1) * kSuper); ++b) {
            const uint8_t* nibbles = panel + b * kPanel * kBlock / 2;
            int32_t dot = 0;
            for (int i = 0; i < kBlock; ++i) dot += weight_q(nibbles, c, i) * qx[b * kBlock + i];
            t = std::fma(static_cast<float>(dot), half_to_float(scales[b * kPanel + c]), t);
          }
          acc = std::fma(t, a.d[r * a.supers + s], acc);
        }
        for (int64_t b = 0; b < nb; ++b) {
          const float dw = half_to_float(scales[b * kPanel + c]);
          const float off = l.offsets ? half_to_float(offsets[b * kPanel + c]) : -8.0f * dw;
          o = std::fma(off, a.dsum[r * nb + b], o);
        }
        y[r * ldy + p * kPanel + c] = acc + o;
      }
    }
  }
}

}  // namespace specc
