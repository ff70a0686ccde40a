// int4 weights x int8 activations: the packed format, the activation quantiser and one kernel per ISA.
//
// The arithmetic every kernel performs, in this order (the scalar reference spells it out):
//   activations: per row and superblock S of 8 blocks (256 inputs; the last may be shorter), d_S = max|x| / 127 and
//     q = round-half-even(x * (127 / max|x|)); per block b, dsum_b = d_S * float(sum of the block's q);
//   for each output (row m, column n): acc = 0; for each superblock S in order, t = 0, then for each block b of S in
//     order: dot = sum of q_w * q_x over the block's 32 inputs (exact int32), t = fma(float(dot), d_w, t); then
//     acc = fma(t, d_S, acc);
//   the offsets: o = 0, then for each block b in order o = fma(offset_w, dsum_b, o) (offset_w = -8 * d_w for
//     symmetric weights);
//   y = acc + o.
// A block's dot is an exact integer whatever the order its products are summed in, so a kernel is free to sum them
// as its instructions like; the float steps, one per block and one per superblock, are fixed. One activation scale
// per superblock (as llama.cpp's Q8_K) leaves a block one fma; the offsets are a second product 32 times smaller.
// Each row's result depends on that row and the weights alone, so a row has the same bits in a pass of any size,
// and every ISA's kernel gives the reference's bits.
#pragma once

#include <cstddef>
#include <cstdint>

namespace specc {

constexpr int kBlock = 32;        // inputs per block
constexpr int kPanel = 16;        // output columns per packed panel: one 512-bit register of int32 lanes
constexpr int kSuper = 8;         // blocks per superblock (one activation scale)
constexpr int kLayoutVersion = 2; // the Int4Gemm operator's `layout` attribute: bundles packed otherwise are refused

// Packed weights of one [N out, K in] layer: panels of 16 columns (N padded). A panel holds its blocks' nibbles in
// order, 256 bytes a block: four chunks of 64 bytes, byte 4c + i of chunk h holding column c's input 8h + i in its
// low nibble and input 8h + 4 + i in its high nibble (i = 0..3), so that the low or the high nibbles of a chunk are
// the 16 columns' next four inputs, the operand of one vpdpbusd. Then the fp16 scales [block][16 columns], then
// (with offsets) the fp16 offsets [block][16]. Without offsets a weight is (q - 8) * scale.
struct Q4Layout {
  int64_t n = 0, k = 0;
  bool offsets = false;
  int64_t blocks() const { return (k + kBlock - 1) / kBlock; }
  int64_t supers() const { return (blocks() + kSuper - 1) / kSuper; }
  int64_t panels() const { return (n + kPanel - 1) / kPanel; }
  int64_t nibble_bytes() const { return blocks() * kPanel * kBlock / 2; }
  int64_t panel_bytes() const { return nibble_bytes() + blocks() * kPanel * 2 * (offsets ? 2 : 1); }
  int64_t bytes() const { return panels() * panel_bytes(); }
};

// Quantised activation rows: q [m][blocks*32], d [m][supers] (per superblock), dsum [m][blocks] (d times the block's
// sum of q).
struct QuantizedRows {
  const int8_t* q;
  const float* d;
  const float* dsum;
  int64_t blocks, supers;
};

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kCount = 4 };

const char* isa_name(Isa isa);
bool isa_supported(Isa isa);
Isa best_isa();

// Software prefetch of the weights a kernel reads next. The rows of a pass multiply a group of panels while the group
// after it is fetched: each block step prefetches its share of that group, so the weights stream from memory at the
// pace the arithmetic uses them.
constexpr int64_t kGroup = 4;  // panels whose weights stay in cache while every row of the pass multiplies them

struct Window {
  const uint8_t* begin = nullptr;
  int64_t bytes = 0;
  // The i-th of `parts` equal shares.
  Window part(int64_t i, int64_t parts) const {
    const int64_t lo = bytes * i / parts, hi = bytes * (i + 1) / parts;
    return begin ? Window{begin + lo, hi - lo} : Window{};
  }
  // Prefetch the b-th of `steps` equal shares, whole cache lines.
  void prefetch(int64_t b, int64_t steps) const {
    if (begin == nullptr) return;
    for (int64_t at = (bytes * b / steps) & ~int64_t{63}, end = bytes * (b + 1) / steps; at < end; at += 64)
      __builtin_prefetch(begin + at, 0, 3);
  }
};

// The bytes of panels [p0, p1), or none.
inline Window panel_span(const uint8_t* w, const Q4Layout& l, int64_t p0, int64_t p1) {
  if (p0 >= p1) return {};
  return {w + p0 * l.panel_bytes(), (p1 - p0) * l.panel_bytes()};
}

// y[0..m) x columns of panels [p0, p1): y has row stride ldy; columns past n are not written. stream: write y's whole
// lines around the caches (non-temporal stores; y and ldy then 64-byte aligned), for outputs larger than the caches.
// after: the weights the calling thread multiplies next, prefetched while the range's last group is multiplied.
using PanelKernel = void (*)(const QuantizedRows& a, int64_t m, const uint8_t* w, const Q4Layout& l, int64_t p0,
                             int64_t p1, float* y, int64_t ldy, bool stream, Window after);

void gemm_panels_scalar(const QuantizedRows&, int64_t, const uint8_t*, const Q4Layout&, int64_t, int64_t, float*, int64_t,
                        bool, Window);
void gemm_panels_avx2(const QuantizedRows&, int64_t, const uint8_t*, const Q4Layout&, int64_t, int64_t, float*, int64_t,
                      bool, Window);
void gemm_panels_avxvnni(const QuantizedRows&, int64_t, const uint8_t*, const Q4Layout&, int64_t, int64_t, float*,
                         int64_t, bool, Window);
void gemm_panels_avx512vnni(const QuantizedRows&, int64_t, const uint8_t*, const Q4Layout&, int64_t, int64_t, float*,
                            int64_t, bool, Window);

// Activation quantiser (the same bits on every ISA): rows [m0, m1) of x [*, k] into q, d and dsum as QuantizedRows
// lays them out.
void quantize_rows(const float* x, int64_t m0, int64_t m1, int64_t k, int64_t blocks, int8_t* q, float* d, float* dsum);
void quantize_rows_avx2(const float* x, int64_t m0, int64_t m1, int64_t k, int64_t blocks, int8_t* q, float* d,
                        float* dsum);

float half_to_float(uint16_t h);

// Runs `iterations` rounds of the ISA's integer dot instructions on registers; returns the MACs done (dot_peak.cpp).
int64_t dot_peak(Isa isa, int64_t iterations);

// y [m, n] = x [m, k] times the packed weight, on `threads` threads of the shared pool. glu: the weight's rows are a
// gated MLP's gate and up projections (n / 2 each, a multiple of 16), and y [m, n / 2] is their SwiGLU (glu.h) of the
// product's two halves, each of which has the bits the plain product gives it.
void gemm(Isa isa, const float* x, int64_t m, const uint8_t* w, const Q4Layout& l, float* y, int threads,
          bool glu = false);

}  // namespace specc
