/* Decode attention over paged KV blocks, float32, for CPUs (built by pdq/engine/cpu_kernels.py).
 *
 * out[b, h*G + g, :] = softmax(scale * q[b, h*G + g] . K_b[t]) V_b[t] over t in [0, lens[b]),
 * where K_b[t] = k_cache[tables[b, t / bs], h, t % bs, :] (and V alike): each sequence's keys
 * are read in place from its blocks, as far as its own length and no further.
 *
 * q, out: [B, H*G, D] contiguous; k_cache, v_cache: [num_blocks, H, bs, D] contiguous;
 * tables: int32 [B, max_blocks]; lens: int32 [B], each >= 1. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                      const int32_t *lens, float *out, int B, int H, int G, int D, int bs, int max_blocks,
                      float scale, int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int bh = 0; bh < B * H; bh++) {
    const int b = bh / H, h = bh % H, len = lens[b];
    const int32_t *table = tables + (size_t)b * max_blocks;
    const float *qb = q + ((size_t)b * H + h) * G * D;
    float *ob = out + ((size_t)b * H + h) * G * D;
    float *s = (float *)malloc(sizeof(float) * (size_t)G * len);
    for (int t0 = 0, j = 0; t0 < len; t0 += bs, j++) {
      const float *kb = k_cache + ((size_t)table[j] * H + h) * bs * D;
      const int n = len - t0 < bs ? len - t0 : bs;
      for (int t = 0; t < n; t++) {
        const float *kr = kb + (size_t)t * D;
        for (int g = 0; g < G; g++) {
          const float *qr = qb + (size_t)g * D;
          float acc = 0.f;
          for (int d = 0; d < D; d++) acc += qr[d] * kr[d];
          s[(size_t)g * len + t0 + t] = acc * scale;
        }
      }
    }
    for (int g = 0; g < G; g++) {
      float *sg = s + (size_t)g * len, m = -INFINITY, sum = 0.f;
      for (int t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
      for (int t = 0; t < len; t++) {
        sg[t] = expf(sg[t] - m);
        sum += sg[t];
      }
      const float inv = 1.f / sum;
      for (int t = 0; t < len; t++) sg[t] *= inv;
    }
    memset(ob, 0, sizeof(float) * (size_t)G * D);
    for (int t0 = 0, j = 0; t0 < len; t0 += bs, j++) {
      const float *vb = v_cache + ((size_t)table[j] * H + h) * bs * D;
      const int n = len - t0 < bs ? len - t0 : bs;
      for (int t = 0; t < n; t++) {
        const float *vr = vb + (size_t)t * D;
        for (int g = 0; g < G; g++) {
          const float p = s[(size_t)g * len + t0 + t];
          float *o = ob + (size_t)g * D;
          for (int d = 0; d < D; d++) o[d] += p * vr[d];
        }
      }
    }
    free(s);
  }
}
