/* A decoder layer's elementwise work, float32 and bfloat16, for CPUs (built by
 * pdq/engine/cpu_kernels.py): each a single pass over its rows where torch runs several ops, each
 * reading and writing the whole tensor. Rows are `stride` elements apart (a view into a wider
 * tensor, e.g. q and k inside the fused qkv projection's output); the last dim is contiguous.
 * Formulas and their order follow the torch code they replace (pdq/engine/layers.py), and in
 * bfloat16 each result is rounded where torch's bfloat16 op rounds it (elem.h), so results differ
 * only by rounding. Weights and rotary tables are of the tensors' own type. Rows are shared among
 * `num_threads` OpenMP threads when there are enough of them to pay. Exported as NAME_f32 and
 * NAME_bf16 (SwiGLU: silu_mul_f32 alone). */
#include <math.h>
#include <stdint.h>

#include "elem.h"

#define PAR_MIN_ELEMENTS 32768

/* out = w * (x / sqrt(mean(x^2) + eps)), the norm in float32 (HF's LlamaRMSNorm: in bfloat16
 * the normalized row is cast back first, then multiplied by the weight) */
INLINE void norm_row(const void *x, const void *w, void *out, int dim, float eps, const int bf) {
  float acc = 0.f;
  for (int d = 0; d < dim; d++) acc += ld(x, d, bf) * ld(x, d, bf);
  const float scale = 1.f / sqrtf(acc / (float)dim + eps);
  for (int d = 0; d < dim; d++) st(out, d, ld(w, d, bf) * rnd(ld(x, d, bf) * scale, bf), bf);
}

/* x += add (in place), then out = rms_norm(x) */
INLINE void add_norm_row(void *x, const void *add, const void *w, void *out, int dim, float eps, const int bf) {
  for (int d = 0; d < dim; d++) st(x, d, ld(x, d, bf) + ld(add, d, bf), bf);
  norm_row(x, w, out, dim, eps, bf);
}

/* one head rotated in place by the row's cos, sin_signed */
INLINE void rotate_head(void *p, const void *c, const void *s, int half, const int bf) {
  for (int i = 0; i < half; i++) {
    const float a = ld(p, i, bf), b = ld(p, i + half, bf);
    st(p, i, rnd(a * ld(c, i, bf), bf) + rnd(b * ld(s, i, bf), bf), bf);
    st(p, i + half, rnd(b * ld(c, i + half, bf), bf) + rnd(a * ld(s, i + half, bf), bf), bf);
  }
}

INLINE void swiglu_row(const void *g, void *o, int inter, const int bf) {
  for (int i = 0; i < inter; i++) {
    const float x = ld(g, i, bf);
    st(o, i, rnd(x / (1.f + expf(-x)), bf) * ld(g, i + inter, bf), bf);
  }
}

/* out[r] = rms_norm(x[r]) */
#define RMS_NORM(NAME, BF)                                                                                       \
  void NAME(const void *x, int64_t x_stride, const void *w, void *out, int64_t out_stride, int rows, int dim,  \
            float eps, int num_threads) {                                                                      \
    _Pragma("omp parallel for num_threads(num_threads) if ((int64_t)rows * dim >= PAR_MIN_ELEMENTS)")           \
    for (int r = 0; r < rows; r++) norm_row(at(x, r * x_stride, BF), w, at(out, r * out_stride, BF), dim, eps, BF); \
  }
RMS_NORM(rms_norm_f32, 0)
RMS_NORM(rms_norm_bf16, 1)

/* x[r] += add[r] (the residual, in place), then out[r] = rms_norm(x[r]) */
#define ADD_RMS_NORM(NAME, BF)                                                                                  \
  void NAME(void *x, int64_t x_stride, const void *add, int64_t add_stride, const void *w, void *out,           \
            int64_t out_stride, int rows, int dim, float eps, int num_threads) {                                \
    _Pragma("omp parallel for num_threads(num_threads) if ((int64_t)rows * dim >= PAR_MIN_ELEMENTS)")           \
    for (int r = 0; r < rows; r++)                                                                              \
      add_norm_row(at(x, r * x_stride, BF), at(add, r * add_stride, BF), w, at(out, r * out_stride, BF), dim,   \
                   eps, BF);                                                                                    \
  }
ADD_RMS_NORM(add_rms_norm_f32, 0)
ADD_RMS_NORM(add_rms_norm_bf16, 1)

/* Rotary embedding in place, rotate-half convention: for row t, head h, x = [x1 | x2],
 * x <- [x1 * cos1 + x2 * sin_signed1 | x2 * cos2 + x1 * sin_signed2], with cos, sin_signed the
 * [rows, dim] tables of the rows' positions (sin_signed = [-sin | sin]). */
#define ROTARY(NAME, BF)                                                                                        \
  void NAME(void *x, int64_t row_stride, int rows, int heads, int dim, const void *cos, const void *sin_signed, \
            int num_threads) {                                                                                  \
    const int half = dim / 2;                                                                                   \
    _Pragma("omp parallel for num_threads(num_threads) if ((int64_t)rows * heads * dim >= PAR_MIN_ELEMENTS)")   \
    for (int t = 0; t < rows; t++) {                                                                            \
      const void *c = at(cos, (int64_t)t * dim, BF), *s = at(sin_signed, (int64_t)t * dim, BF);                 \
      for (int h = 0; h < heads; h++) rotate_head(at(x, t * row_stride + (int64_t)h * dim, BF), c, s, half, BF); \
    }                                                                                                           \
  }
ROTARY(rotary_f32, 0)
ROTARY(rotary_bf16, 1)

/* rotary over q and k heads (row t: `q_heads + kv_heads` heads from x + t * row_stride), then
 * this step's K/V into the layer's pool: k head h of row t (rotated) and v head h (row t of v,
 * `v_stride` apart) go to pool row kv_rows[t * kv_heads + h] of k_cache and v_cache (viewed as
 * [rows, dim]). One pass instead of rotary plus two index copies. */
#define ROTARY_KV(NAME, BF)                                                                                     \
  void NAME(void *x, int64_t row_stride, int rows, int q_heads, int kv_heads, int dim, const void *cos,         \
            const void *sin_signed, const void *v, int64_t v_stride, const int64_t *kv_rows, void *k_cache,     \
            void *v_cache, int num_threads) {                                                                   \
    const int half = dim / 2, heads = q_heads + kv_heads;                                                       \
    const size_t row_bytes = (size_t)dim * (BF ? 2 : 4);                                                        \
    _Pragma("omp parallel for num_threads(num_threads) if ((int64_t)rows * heads * dim >= PAR_MIN_ELEMENTS)")   \
    for (int t = 0; t < rows; t++) {                                                                            \
      const void *c = at(cos, (int64_t)t * dim, BF), *s = at(sin_signed, (int64_t)t * dim, BF);                 \
      for (int h = 0; h < heads; h++) {                                                                         \
        void *p = at(x, t * row_stride + (int64_t)h * dim, BF);                                                 \
        rotate_head(p, c, s, half, BF);                                                                         \
        if (h >= q_heads) {                                                                                     \
          const int64_t row = kv_rows[(int64_t)t * kv_heads + (h - q_heads)] * dim;                             \
          memcpy(at(k_cache, row, BF), p, row_bytes);                                                           \
          memcpy(at(v_cache, row, BF), at(v, t * v_stride + (int64_t)(h - q_heads) * dim, BF), row_bytes);      \
        }                                                                                                       \
      }                                                                                                         \
    }                                                                                                           \
  }
ROTARY_KV(rotary_kv_f32, 0)
ROTARY_KV(rotary_kv_bf16, 1)

/* SwiGLU: out[r, i] = silu(g) * u for gate_up[r] = [g | u], `inter` each */
#define SILU_MUL(NAME, BF)                                                                                      \
  void NAME(const void *gate_up, int64_t stride, void *out, int rows, int inter, int num_threads) {             \
    _Pragma("omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= PAR_MIN_ELEMENTS)")         \
    for (int r = 0; r < rows; r++) swiglu_row(at(gate_up, r * stride, BF), at(out, (int64_t)r * inter, BF), inter, BF); \
  }
SILU_MUL(silu_mul_f32, 0) /* bfloat16: torch's ops are faster (pdq/engine/layers.py: silu_and_mul) */
