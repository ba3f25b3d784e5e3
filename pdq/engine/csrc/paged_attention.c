/* Decode attention over paged KV blocks, float32 and bfloat16 (paged_decode_f32, _bf16), for CPUs
 * (built by pdq/engine/cpu_kernels.py).
 *
 * out[b, h*G + g, :] = softmax(scale * q[b, h*G + g] . K_b[t]) V_b[t] over t in [0, lens[b]),
 * where K_b[t] = k_cache[tables[b, t / bs], h, t % bs, :] (and V alike): each sequence's keys
 * are read in place from its blocks, as far as its own length and no further.
 *
 * q, out: [B, H*G, D] contiguous; k_cache, v_cache: [num_blocks, H, bs, D] contiguous;
 * tables: int32 [B, max_blocks]; lens: int32 [B], each >= 1.
 *
 * A step reads every running sequence's keys and values once, so the kernel is bound by how
 * fast it reads them. A block holds every KV head's keys, contiguous: one work item takes a
 * sequence's blocks whole, all heads together (a head's own part of a block is only bs * D
 * floats, and reading those one head at a time, 16 KB apart, ran at half the speed). With fewer
 * sequences than twice the threads, each sequence's heads are split into parts, one item each,
 * so that every thread has work. The G query heads of a KV head share each key and value read. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "elem.h"

/* work item `item` of paged_decode: sequence b's heads [h0, h1) */
INLINE void decode_item(const void *q, const void *k_cache, const void *v_cache, const int32_t *tables,
                        const int32_t *lens, void *out, int H, int G, int D, int bs, int max_blocks, float scale,
                        int parts, int item, const int bf) {
  const int b = item / parts, part = item % parts, len = lens[b];
  const int h0 = part * H / parts, h1 = (part + 1) * H / parts, nh = h1 - h0;
  const int32_t *table = tables + (size_t)b * max_blocks;
  const size_t block = (size_t)H * bs * D; /* elements per block, all heads */
  const size_t rows = (size_t)nh * G;       /* query rows (h, g) of this item, row r = (h - h0) * G + g */
  /* scores s[r * len + t], then the query rows and the output rows in float32 */
  float *s = (float *)malloc(sizeof(float) * (rows * len + 2 * rows * D));
  float *qf = s + rows * len, *of = qf + rows * D;
  const int64_t q0 = ((int64_t)b * H + h0) * G * D;
  for (size_t i = 0; i < rows * D; i++) qf[i] = ld(q, q0 + (int64_t)i, bf);
  for (int t0 = 0, j = 0; t0 < len; t0 += bs, j++) {
    const int n = len - t0 < bs ? len - t0 : bs;
    for (int h = h0; h < h1; h++) {
      const int64_t kb = (int64_t)table[j] * block + (int64_t)h * bs * D;
      const float *qb = qf + (size_t)(h - h0) * G * D;
      float *sh = s + (size_t)(h - h0) * G * len + t0;
      for (int t = 0; t < n; t++) {
        const int64_t kr = kb + (int64_t)t * D;
        for (int g = 0; g < G; g++) {
          const float *qr = qb + (size_t)g * D;
          float acc = 0.f;
          for (int d = 0; d < D; d++) acc += qr[d] * ld(k_cache, kr + d, bf);
          sh[(size_t)g * len + t] = acc * scale;
        }
      }
    }
  }
  for (size_t r = 0; r < rows; r++) {
    float *sg = s + r * len, m = -INFINITY, sum = 0.f;
    for (int t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
    for (int t = 0; t < len; t++) {
      sg[t] = expf(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (int t = 0; t < len; t++) sg[t] *= inv;
  }
  memset(of, 0, sizeof(float) * rows * D);
  for (int t0 = 0, j = 0; t0 < len; t0 += bs, j++) {
    const int n = len - t0 < bs ? len - t0 : bs;
    for (int h = h0; h < h1; h++) {
      const int64_t vb = (int64_t)table[j] * block + (int64_t)h * bs * D;
      const float *sh = s + (size_t)(h - h0) * G * len + t0;
      float *oh = of + (size_t)(h - h0) * G * D;
      for (int t = 0; t < n; t++) {
        const int64_t vr = vb + (int64_t)t * D;
        for (int g = 0; g < G; g++) {
          const float p = sh[(size_t)g * len + t];
          float *o = oh + (size_t)g * D;
          for (int d = 0; d < D; d++) o[d] += p * ld(v_cache, vr + d, bf);
        }
      }
    }
  }
  for (size_t i = 0; i < rows * D; i++) st(out, q0 + (int64_t)i, of[i], bf);
  free(s);
}

/* decode_item with the head size D and the query group G as constants for the common shapes, so
 * that the compiler unrolls each dot product and each row update whole (no remainder loops) and
 * keeps a key's or value's row in registers for all G query heads; other shapes read them at run
 * time. What it gains: BENCHMARKS.md, "CPU decode attention: head shapes as constants". */
#define ITEM(GC, DC) decode_item(q, k_cache, v_cache, tables, lens, out, H, GC, DC, bs, max_blocks, scale, parts, item, bf)
INLINE void decode_shape(const void *q, const void *k_cache, const void *v_cache, const int32_t *tables,
                         const int32_t *lens, void *out, int H, int G, int D, int bs, int max_blocks, float scale,
                         int parts, int item, const int bf) {
  if (D == 64 && G == 1) ITEM(1, 64);
  else if (D == 64 && G == 2) ITEM(2, 64);
  else if (D == 64 && G == 4) ITEM(4, 64);
  else if (D == 64 && G == 8) ITEM(8, 64);
  else if (D == 64) ITEM(G, 64);
  else if (D == 128 && G == 1) ITEM(1, 128);
  else if (D == 128 && G == 2) ITEM(2, 128);
  else if (D == 128 && G == 4) ITEM(4, 128);
  else if (D == 128 && G == 8) ITEM(8, 128);
  else if (D == 128) ITEM(G, 128);
  else ITEM(G, D);
}
#undef ITEM

/* q, out: [B, H*G, D]; k_cache, v_cache: [num_blocks, H, bs, D]; all of one type */
#define PAGED_DECODE(NAME, BF)                                                                                   \
  void NAME(const void *q, const void *k_cache, const void *v_cache, const int32_t *tables, const int32_t *lens, \
            void *out, int B, int H, int G, int D, int bs, int max_blocks, float scale, int num_threads) {        \
    int parts = 1; /* head ranges per sequence */                                                               \
    if (B < 2 * num_threads) {                                                                                  \
      parts = (2 * num_threads + B - 1) / B;                                                                    \
      if (parts > H) parts = H;                                                                                 \
    }                                                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                                  \
    for (int item = 0; item < B * parts; item++)                                                                \
      decode_shape(q, k_cache, v_cache, tables, lens, out, H, G, D, bs, max_blocks, scale, parts, item, BF);    \
  }
PAGED_DECODE(paged_decode_f32, 0)
PAGED_DECODE(paged_decode_bf16, 1)
