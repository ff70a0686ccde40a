// int4 weights x int8 activations: the packed format, the activation quantiser and one kernel per ISA.
//
// The arithmetic every kernel performs, in this order (the scalar reference spells it out):
//   activations: per row and superblock S of 8 blocks (256 inputs; the last may be shorter), d_S = max|x| / 127 and
//     q = round-half-even(x * (127 / max|x|)); per block b, dsum_b = d_S * float(sum of the block's q);
//   for each output (row m, column n), eight float lanes j = 0..7; for each superblock S in order, t_j = 0, then for
//     each block b of S in order: dot_j = sum of q_w * q_x over the block's inputs 4j..4j+3 (exact int32),
//     t_j = fma(float(dot_j), d_w, t_j); then lane_j = fma(t_j, d_S, lane_j);
//   the offsets: o = 0, then for each block b in order o = fma(offset_w, dsum_b, o);
//   y = (((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))) + o.
// One activation scale per superblock (as llama.cpp's Q8_K) leaves a block one fma per lane; the offsets, one number
// per block and column, are a second, 32 times smaller product. Each row's result depends on that row and the
// weights alone, so a row has the same bits in a pass of any size, and every ISA's kernel gives the reference's bits.
#pragma once

#include <cstddef>
#include <cstdint>

namespace specc {

constexpr int kBlock = 32;   // inputs per block
constexpr int kTile = 8;     // output columns per packed tile
constexpr int kLanes = 8;    // float lanes per output
constexpr int kSuper = 8;    // blocks per superblock (one activation scale)

// Packed weights of one [N out, K in] layer: column tiles of 8, each tile's blocks in order. A tile-block holds
// 4 column pairs of 32 bytes (byte i of pair p: column 2p's input i in the low nibble, column 2p+1's in the high),
// then 8 fp16 scales, then (with offsets) 8 fp16 offsets. Without offsets a weight is (q - 8) * scale.
struct Q4Layout {
  int64_t n = 0, k = 0;
  bool offsets = false;
  int64_t blocks() const { return (k + kBlock - 1) / kBlock; }
  int64_t supers() const { return (blocks() + kSuper - 1) / kSuper; }
  int64_t tiles() const { return (n + kTile - 1) / kTile; }
  int64_t tile_block_bytes() const { return kTile * kBlock / 2 + kTile * 2 * (offsets ? 2 : 1); }
  int64_t tile_bytes() const { return blocks() * tile_block_bytes(); }
  int64_t bytes() const { return tiles() * tile_bytes(); }
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

// y[m0..m1) x columns of tiles [t0, t1): y has row stride ldy; columns past n are not written.
using TileKernel = void (*)(const QuantizedRows& a, int64_t m0, int64_t m1, const uint8_t* w, const Q4Layout& l,
                            int64_t t0, int64_t t1, float* y, int64_t ldy);

void gemm_tiles_scalar(const QuantizedRows&, int64_t, int64_t, const uint8_t*, const Q4Layout&, int64_t, int64_t, float*, int64_t);
void gemm_tiles_avx2(const QuantizedRows&, int64_t, int64_t, const uint8_t*, const Q4Layout&, int64_t, int64_t, float*, int64_t);
void gemm_tiles_avxvnni(const QuantizedRows&, int64_t, int64_t, const uint8_t*, const Q4Layout&, int64_t, int64_t, float*, int64_t);
void gemm_tiles_avx512vnni(const QuantizedRows&, int64_t, int64_t, const uint8_t*, const Q4Layout&, int64_t, int64_t, float*, int64_t);

// Activation quantiser (the same bits on every ISA): rows [m0, m1) of x [*, k] into q, d and dsum as QuantizedRows
// lays them out.
void quantize_rows(const float* x, int64_t m0, int64_t m1, int64_t k, int64_t blocks, int8_t* q, float* d, float* dsum);
void quantize_rows_avx2(const float* x, int64_t m0, int64_t m1, int64_t k, int64_t blocks, int8_t* q, float* d,
                        float* dsum);

float half_to_float(uint16_t h);

// Runs `iterations` rounds of the ISA's integer dot instructions on registers; returns the MACs done (dot_peak.cpp).
int64_t dot_peak(Isa isa, int64_t iterations);

// y [m, n] = x [m, k] times the packed weight, on `threads` threads of the shared pool.
void gemm(Isa isa, const float* x, int64_t m, const uint8_t* w, const Q4Layout& l, float* y, int threads);

}  // namespace specc
