/* A decoder layer's elementwise work, float32, for CPUs (built by pdq/engine/cpu_kernels.py):
 * each a single pass over its rows where torch runs several ops, each reading and writing the
 * whole tensor. Rows are `stride` floats apart (a view into a wider tensor, e.g. q and k inside
 * the fused qkv projection's output); the last dim is contiguous. Formulas and their order
 * follow the torch code they replace (pdq/engine/layers.py), so results differ only by rounding.
 * Rows are shared among `num_threads` OpenMP threads when there are enough of them to pay. */
#include <math.h>
#include <stdint.h>

#define PAR_MIN_ELEMENTS 32768

static inline void norm_row(const float *x, const float *w, float *out, int dim, float eps) {
  float acc = 0.f;
  for (int d = 0; d < dim; d++) acc += x[d] * x[d];
  const float scale = 1.f / sqrtf(acc / (float)dim + eps);
  for (int d = 0; d < dim; d++) out[d] = w[d] * (x[d] * scale);
}

/* out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps))  (HF's LlamaRMSNorm in float32) */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t out_stride, int rows,
                  int dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * dim >= PAR_MIN_ELEMENTS)
  for (int r = 0; r < rows; r++) norm_row(x + r * x_stride, w, out + r * out_stride, dim, eps);
}

/* x[r] += add[r] (the residual, in place), then out[r] = rms_norm(x[r]) */
void add_rms_norm_f32(float *x, int64_t x_stride, const float *add, int64_t add_stride, const float *w, float *out,
                      int64_t out_stride, int rows, int dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * dim >= PAR_MIN_ELEMENTS)
  for (int r = 0; r < rows; r++) {
    float *xr = x + r * x_stride;
    const float *ar = add + r * add_stride;
    for (int d = 0; d < dim; d++) xr[d] = xr[d] + ar[d];
    norm_row(xr, w, out + r * out_stride, dim, eps);
  }
}

static inline void rotate_head(float *p, const float *c, const float *s, int half) {
  for (int i = 0; i < half; i++) {
    const float a = p[i], b = p[i + half];
    p[i] = a * c[i] + b * s[i];
    p[i + half] = b * c[i + half] + a * s[i + half];
  }
}

/* Rotary embedding in place, rotate-half convention: for row t, head h, x = [x1 | x2],
 * x <- [x1 * cos1 + x2 * sin_signed1 | x2 * cos2 + x1 * sin_signed2], with cos, sin_signed the
 * [rows, dim] tables of the rows' positions (sin_signed = [-sin | sin]). */
void rotary_f32(float *x, int64_t row_stride, int rows, int heads, int dim, const float *cos,
                const float *sin_signed, int num_threads) {
  const int half = dim / 2;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * heads * dim >= PAR_MIN_ELEMENTS)
  for (int t = 0; t < rows; t++) {
    const float *c = cos + (int64_t)t * dim, *s = sin_signed + (int64_t)t * dim;
    for (int h = 0; h < heads; h++) rotate_head(x + t * row_stride + (int64_t)h * dim, c, s, half);
  }
}

/* rotary_f32 over q and k heads (row t: `q_heads + kv_heads` heads from x + t * row_stride), then
 * this step's K/V into the layer's pool: k head h of row t (rotated) and v head h (row t of v,
 * `v_stride` apart) go to pool row kv_rows[t * kv_heads + h] of k_cache and v_cache (viewed as
 * [rows, dim]). One pass instead of rotary plus two index copies. */
void rotary_kv_f32(float *x, int64_t row_stride, int rows, int q_heads, int kv_heads, int dim, const float *cos,
                   const float *sin_signed, const float *v, int64_t v_stride, const int64_t *kv_rows, float *k_cache,
                   float *v_cache, int num_threads) {
  const int half = dim / 2, heads = q_heads + kv_heads;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * heads * dim >= PAR_MIN_ELEMENTS)
  for (int t = 0; t < rows; t++) {
    const float *c = cos + (int64_t)t * dim, *s = sin_signed + (int64_t)t * dim;
    for (int h = 0; h < heads; h++) {
      float *p = x + t * row_stride + (int64_t)h * dim;
      rotate_head(p, c, s, half);
      if (h >= q_heads) {
        const int64_t at = kv_rows[(int64_t)t * kv_heads + (h - q_heads)] * dim;
        const float *vr = v + t * v_stride + (int64_t)(h - q_heads) * dim;
        for (int i = 0; i < dim; i++) {
          k_cache[at + i] = p[i];
          v_cache[at + i] = vr[i];
        }
      }
    }
  }
}

/* SwiGLU: out[r, i] = silu(g) * u for gate_up[r] = [g | u], `inter` each */
void silu_mul_f32(const float *gate_up, int64_t stride, float *out, int rows, int inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= PAR_MIN_ELEMENTS)
  for (int r = 0; r < rows; r++) {
    const float *g = gate_up + r * stride, *u = g + inter;
    float *o = out + (int64_t)r * inter;
    for (int i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
}
