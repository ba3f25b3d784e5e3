/* Element access for kernels built for float32 and bfloat16 alike (pdq/engine/cpu_kernels.py).
 *
 * A kernel's row helpers take `const int bf` (1: the tensors hold bfloat16, stored as uint16_t;
 * 0: float32) and are always inlined into exported wrappers that pass a constant, so each
 * wrapper compiles to code for its own type with no branch left in a loop. Arithmetic is float32
 * either way; `rnd` rounds a float32 value to bfloat16 precision, where torch's bfloat16 op
 * would have rounded (each bfloat16 op's result), so the kernels round as the torch code they
 * replace. Conversions round to nearest even, as torch's do (a NaN stays a NaN). */
#ifndef PDQ_ELEM_H
#define PDQ_ELEM_H
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

INLINE uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN: quiet */
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* element i of a float32 (bf = 0) or bfloat16 (bf = 1) array, as float32 */
INLINE float ld(const void *p, int64_t i, const int bf) {
  return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st(void *p, int64_t i, float v, const int bf) {
  if (bf)
    ((uint16_t *)p)[i] = f32_to_bf16(v);
  else
    ((float *)p)[i] = v;
}

/* v rounded as a bfloat16 op's result is (bf = 1); v itself (bf = 0) */
INLINE float rnd(float v, const int bf) { return bf ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* p advanced by i elements */
INLINE void *at(const void *p, int64_t i, const int bf) { return (char *)p + i * (bf ? 2 : 4); }

#endif
