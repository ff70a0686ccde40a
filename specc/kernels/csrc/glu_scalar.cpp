// The SwiGLU reference: glu_impl.inc over the 16-lane vector spelled out lane by lane.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "glu.h"
#include "vec16.h"

namespace specc {

namespace {

#include "vec16_scalar.inc"
#include "vec16_math.inc"
#include "glu_impl.inc"

}  // namespace

void swiglu_scalar(const float* gate, const float* up, float* y, int64_t n, bool stream) {
  swiglu_lanes<LanesScalar>(gate, up, y, n, stream);
}

}  // namespace specc
