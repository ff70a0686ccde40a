// SwiGLU, the activation of a gated MLP: y = silu(g) * u over the two halves of a merged gate-and-up layer's output,
// with the same bits on every ISA. Lane by lane, in this order (vec16_math.inc's operations):
//   e = exp_approx(min(0 - g, 80))      (exp_approx takes its argument below -80 as -80)
//   y = (g / (1 + e)) * u
// that is silu(g) = g * sigmoid(g) = g / (1 + exp(-g)); the bound keeps e finite where g < -80 (silu(g) is then
// g / 5.5e34, zero to within float).
#pragma once

#include <cstdint>

#include "q4gemm.h"

namespace specc {

// y[0..n) = swiglu(gate[i], up[i]); stream: y written with whole-line non-temporal stores (n a multiple of 16, y
// 64-byte aligned).
using GluKernel = void (*)(const float* gate, const float* up, float* y, int64_t n, bool stream);
void swiglu_scalar(const float* gate, const float* up, float* y, int64_t n, bool stream);
void swiglu_avx2(const float* gate, const float* up, float* y, int64_t n, bool stream);
void swiglu_avx512(const float* gate, const float* up, float* y, int64_t n, bool stream);

// The ISA's kernel (the AVX-VNNI class runs AVX2's, the AVX-512 VNNI class AVX-512's).
GluKernel glu_kernel(Isa isa);

}  // namespace specc
