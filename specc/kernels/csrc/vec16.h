// The width of the 16-lane vector types (vec16_*.inc) the CacheAttention and SwiGLU kernels are written over.
#pragma once

namespace specc {

constexpr int kLanes = 16;

}  // namespace specc
