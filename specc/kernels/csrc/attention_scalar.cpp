// The CacheAttention reference: attention_impl.inc over a 16-lane vector spelled out lane by lane, each operation
// the one the SIMD kernels' instruction performs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention.h"

namespace specc {

namespace {

struct LanesScalar {
  struct reg {
    float l[kLanes];
  };
  template <class F>
  static reg each(F f) {
    reg r;
    for (int i = 0; i < kLanes; ++i) r.l[i] = f(i);
    return r;
  }
  static reg zero() { return each([](int) { return 0.0f; }); }
  static reg set1(float x) { return each([x](int) { return x; }); }
  static reg load(const float* p) { return each([p](int i) { return p[i]; }); }
  static void store(float* p, const reg& a) { std::memcpy(p, a.l, sizeof(a.l)); }
  static reg mul(const reg& a, const reg& b) { return each([&](int i) { return a.l[i] * b.l[i]; }); }
  static reg add(const reg& a, const reg& b) { return each([&](int i) { return a.l[i] + b.l[i]; }); }
  static reg sub(const reg& a, const reg& b) { return each([&](int i) { return a.l[i] - b.l[i]; }); }
  static reg div(const reg& a, const reg& b) { return each([&](int i) { return a.l[i] / b.l[i]; }); }
  static reg fma(const reg& a, const reg& b, const reg& c) {
    return each([&](int i) { return std::fma(a.l[i], b.l[i], c.l[i]); });
  }
  static reg max(const reg& a, const reg& b) { return each([&](int i) { return a.l[i] > b.l[i] ? a.l[i] : b.l[i]; }); }
  static reg round(const reg& a) { return each([&](int i) { return std::nearbyint(a.l[i]); }); }
  static reg pow2(const reg& n) {
    return each([&](int i) {
      const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.l[i]) + 127) << 23;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    });
  }
  static reg keep(uint32_t bits, const reg& a) {
    return each([&](int i) { return (bits >> i) & 1 ? a.l[i] : 0.0f; });
  }
  static float hsum(const reg& a) {
    float t[8];
    for (int i = 0; i < 8; ++i) t[i] = a.l[i] + a.l[i + 8];
    for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
    for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
    return t[0] + t[1];
  }
  static reg hsums(const reg* d) { return each([d](int j) { return hsum(d[j]); }); }
  static constexpr bool kWideRegisterFile = false;
  static uint32_t nonzero16(const uint8_t* p) {
    uint32_t bits = 0;
    for (int i = 0; i < kLanes; ++i) bits |= static_cast<uint32_t>(p[i] != 0) << i;
    return bits;
  }
};

#include "attention_impl.inc"

}  // namespace

void attend_scalar(const AttentionArgs& a, int64_t b, int64_t hkv, int64_t i0, int64_t i1, AttentionScratch& s) {
  attend<LanesScalar>(a, b, hkv, i0, i1, s);
}

}  // namespace specc
