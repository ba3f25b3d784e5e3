/* Decode attention over paged KV blocks, float32, for CPUs (built by pdq/engine/cpu_kernels.py).
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

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                      const int32_t *lens, float *out, int B, int H, int G, int D, int bs, int max_blocks,
                      float scale, int num_threads) {
  int parts = 1; /* head ranges per sequence */
  if (B < 2 * num_threads) {
    parts = (2 * num_threads + B - 1) / B;
    if (parts > H) parts = H;
  }
  const size_t block = (size_t)H * bs * D; /* floats per block, all heads */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int item = 0; item < B * parts; item++) {
    const int b = item / parts, part = item % parts, len = lens[b];
    const int h0 = part * H / parts, h1 = (part + 1) * H / parts, nh = h1 - h0;
    const int32_t *table = tables + (size_t)b * max_blocks;
    /* scores of query row (h, g): s[((h - h0) * G + g) * len + t] */
    float *s = (float *)malloc(sizeof(float) * (size_t)nh * G * len);
    for (int t0 = 0, j = 0; t0 < len; t0 += bs, j++) {
      const int n = len - t0 < bs ? len - t0 : bs;
      for (int h = h0; h < h1; h++) {
        const float *kb = k_cache + (size_t)table[j] * block + (size_t)h * bs * D;
        const float *qb = q + ((size_t)b * H + h) * G * D;
        float *sh = s + (size_t)(h - h0) * G * len + t0;
        for (int t = 0; t < n; t++) {
          const float *kr = kb + (size_t)t * D;
          for (int g = 0; g < G; g++) {
            const float *qr = qb + (size_t)g * D;
            float acc = 0.f;
            for (int d = 0; d < D; d++) acc += qr[d] * kr[d];
            sh[(size_t)g * len + t] = acc * scale;
          }
        }
      }
    }
    for (int r = 0; r < nh * G; r++) {
      float *sg = s + (size_t)r * len, m = -INFINITY, sum = 0.f;
      for (int t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
      for (int t = 0; t < len; t++) {
        sg[t] = expf(sg[t] - m);
        sum += sg[t];
      }
      const float inv = 1.f / sum;
      for (int t = 0; t < len; t++) sg[t] *= inv;
    }
    float *ob = out + ((size_t)b * H + h0) * G * D;
    memset(ob, 0, sizeof(float) * (size_t)nh * G * D);
    for (int t0 = 0, j = 0; t0 < len; t0 += bs, j++) {
      const int n = len - t0 < bs ? len - t0 : bs;
      for (int h = h0; h < h1; h++) {
        const float *vb = v_cache + (size_t)table[j] * block + (size_t)h * bs * D;
        const float *sh = s + (size_t)(h - h0) * G * len + t0;
        float *oh = ob + (size_t)(h - h0) * G * D;
        for (int t = 0; t < n; t++) {
          const float *vr = vb + (size_t)t * D;
          for (int g = 0; g < G; g++) {
            const float p = sh[(size_t)g * len + t];
            float *o = oh + (size_t)g * D;
            for (int d = 0; d < D; d++) o[d] += p * vr[d];
          }
        }
      }
    }
    free(s);
  }
}
