/* Row-wise ops around SPLASH's CPU GEMMs, each one call in place of several torch ops: rms_norm, rope, swiglu;
   and DeepSeek-V3's MoE bookkeeping: moe_route (group-limited top-k routing), moe_sort (the experts' row order for
   the grouped GEMM). */
#include "kernels.h"

static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_hadd_ps(a, a);
    a = _mm_hadd_ps(a, a);
    return _mm_cvtss_f32(a);
}

/* RMSNorm of n rows of width d (row r at x + r * ldx): y = x * (1 / sqrt(mean(x^2) + eps)) * w, y contiguous.
   d % 8 == 0. */
void rms_norm(const float *x, int64_t n, int d, int64_t ldx, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * ldx;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) { __m256 v = _mm256_loadu_ps(xr + i); acc = _mm256_fmadd_ps(v, v, acc); }
        __m256 inv = _mm256_set1_ps(1.f / sqrtf(hsum(acc) / d + eps));
        for (int i = 0; i < d; i += 8)
            _mm256_storeu_ps(y + r * d + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv), _mm256_loadu_ps(w + i)));
    }
}

/* Rotary embedding of x [n, H, dim] (strides sn, sh; last dim contiguous) with cos/sin [n, dim / 2] into y (strides
   yn, yh): pairs (x1, x2) are (x[2i], x[2i+1]) when `interleave` (DeepSeek's layout), else (x[i], x[i + dim/2]);
   y's row is [x1 cos - x2 sin, x2 cos + x1 sin], de-interleaved. */
void rope_to(const float *x, int64_t n, int64_t H, int64_t sn, int64_t sh, int dim, int interleave,
                    const float *cos, const float *sin, float *y, int64_t yn, int64_t yh) {
    int half = dim / 2;
    for (int64_t r = 0; r < n; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < H; h++) {
            const float *xh = x + r * sn + h * sh;
            float *o = y + r * yn + h * yh;
            for (int i = 0; i < half; i++) {
                float x1 = interleave ? xh[2 * i] : xh[i], x2 = interleave ? xh[2 * i + 1] : xh[i + half];
                o[i] = x1 * c[i] - x2 * s[i];
                o[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* rope_to with y [n, H, dim] contiguous. */
void rope(const float *x, int64_t n, int64_t H, int64_t sn, int64_t sh, int dim, int interleave, const float *cos,
          const float *sin, float *y) {
    rope_to(x, n, H, sn, sh, dim, interleave, cos, sin, y, H * dim, dim);
}

/* SwiGLU of n rows [gate | up] (width 2 * d, row stride ldh): y [n, d] = silu(gate) * up. d % 8 == 0. */
void swiglu(const float *h, int64_t n, int d, int64_t ldh, float *y) {
    __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < n; r++)
        for (int i = 0; i < d; i += 8) {
            __m256 g = _mm256_loadu_ps(h + r * ldh + i), u = _mm256_loadu_ps(h + r * ldh + d + i);
            __m256 sg = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
            _mm256_storeu_ps(y + r * d + i, _mm256_mul_ps(sg, u));
        }
}

/* DeepSeek-V3 routing of n token rows from their sigmoid scores [n, E] and the correction bias [E]: choice =
   score + bias; each of G groups scores the sum of its top min(2, E / G) choices; the top `tg` groups stay
   eligible; the top k eligible experts by choice (descending; the first index on ties) are the token's: idx [n, k],
   weighted by their scores, normalised to sum 1 when `norm` (+ 1e-20), then times `scale`: wt [n, k].
   Returns 0, or -1 when E > 1024 or E / G / tg / k are out of range. */
int moe_route(const float *score, const float *bias, int64_t n, int E, int G, int tg, int k, int norm, float scale,
              int64_t *idx, float *wt) {
    if (E <= 0 || E > 1024 || G <= 0 || E % G || tg <= 0 || tg > G || k <= 0 || k > E / G * tg) return -1;
    int per = E / G, top = per < 2 ? per : 2;
    float choice[1024], gs[1024], w[1024];
    unsigned char ok[1024], taken[1024];
    for (int64_t t = 0; t < n; t++) {
        const float *s = score + t * E;
        for (int e = 0; e < E; e++) choice[e] = s[e] + bias[e];
        for (int g = 0; g < G; g++) {   /* sum of the group's top `top` choices */
            float a = -INFINITY, b = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                float c = choice[e];
                if (c > a) { b = a; a = c; } else if (c > b) b = c;
            }
            gs[g] = top == 2 ? a + b : a;
        }
        for (int e = 0; e < E; e++) ok[e] = 0;
        for (int g = 0; g < G; g++) taken[g] = 0;
        for (int i = 0; i < tg; i++) {   /* the top tg groups */
            int best = -1;
            for (int g = 0; g < G; g++) if (!taken[g] && (best < 0 || gs[g] > gs[best])) best = g;
            taken[best] = 1;
            for (int e = best * per; e < (best + 1) * per; e++) ok[e] = 1;
        }
        float sum = 0.f;
        for (int j = 0; j < k; j++) {   /* the top k eligible experts */
            int best = -1;
            for (int e = 0; e < E; e++) if (ok[e] && (best < 0 || choice[e] > choice[best])) best = e;
            ok[best] = 0;
            idx[t * k + j] = best;
            w[j] = s[best];
            sum += w[j];
        }
        for (int j = 0; j < k; j++) wt[t * k + j] = (norm ? w[j] / (sum + 1e-20f) : w[j]) * scale;
    }
    return 0;
}

/* The grouped GEMM's row order from a routing (idx, wt [n, k], ids in [0, E)): counts [E], and for each (token,
   expert) pair in expert order — tokens ascending within an expert, as a stable argsort of the flat ids gives —
   its token tok [n k] and weight wsort [n k]. Returns 0, or -1 when an id is outside [0, E). */
int moe_sort(const int64_t *idx, const float *wt, int64_t n, int k, int E, int64_t *counts, int64_t *tok,
             float *wsort) {
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1)), o = 0;
    if (!off) return -1;
    for (int e = 0; e < E; e++) counts[e] = 0;
    for (int64_t i = 0; i < n * k; i++) {
        if (idx[i] < 0 || idx[i] >= E) { free(off); return -1; }
        counts[idx[i]]++;
    }
    for (int e = 0; e < E; e++) { off[e] = o; o += counts[e]; }
    for (int64_t i = 0; i < n * k; i++) {
        int64_t p = off[idx[i]]++;
        tok[p] = i / k;
        wsort[p] = wt[i];
    }
    free(off);
    return 0;
}
