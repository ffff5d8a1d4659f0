/* SPLASH's CPU kernels (x86-64 AVX2 + FMA, fp32, one thread), loaded by splash/native/__init__.py with ctypes.

   grouped_gemm: the MoE experts' GEMMs. Rows of x sorted by expert (counts[e] rows for expert e) times each
   expert's weight, stored packed: per expert, strips of 16 output columns, each strip [K][16] input-major, so a
   strip streams from memory once and stays in L1 while every row tile of the expert reads it. Tiles of up to 6
   rows x 16 columns keep 12 accumulators in registers. Each output element is one dot product in k order: a row's
   result does not depend on which other rows share its expert.

   mla_decode: MLA attention of query rows over the paged latent cache, read in place through the page table: one
   entry per row (a decode row, or one row of a prefill chunk, which sees the keys up to its own position); per
   entry, page by page, scores of every head against the page's visible keys, then an online-softmax fold of the
   page into a running (max, sum, output) per head. Scratch is heads x (d_c + block) floats per call, whatever
   the batch and context.

   linear_packed, rms_norm, rope, swiglu: one packed dense weight's GEMM and the row-wise ops around the GEMMs, each
   one call in place of several torch ops.

   absorb_rope, uv_heads: MLA's per-head GEMMs around the attention (q_nope @ W_UK with the rotated q_rope into the
   absorbed queries; õ @ W_UV^T into O's input), reading the per-head weights in place.

   moe_route, moe_sort, moe_combine: DeepSeek-V3's group-limited top-k routing, the experts' row order for the
   grouped GEMM, and the weighted scatter of the experts' outputs back to their tokens — each one call in place of
   ~10 small torch ops a MoE layer. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LOADW const float *wk = w + (int64_t)k * ldw; __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
#define B(i) { __m256 t = _mm256_broadcast_ss(x + (i) * ldx + k); a##i = _mm256_fmadd_ps(t, w0, a##i); b##i = _mm256_fmadd_ps(t, w1, b##i); }
#define S(i) _mm256_storeu_ps(y + (i) * ldy, a##i); _mm256_storeu_ps(y + (i) * ldy + 8, b##i);

static void tile1(const float *x, int64_t ldx, int K, const float *w, int64_t ldw, float *y, int64_t ldy) {
    __m256 a0=_mm256_setzero_ps(),b0=a0;
    for (int k = 0; k < K; k++) { LOADW B(0) }
    S(0)
}
static void tile2(const float *x, int64_t ldx, int K, const float *w, int64_t ldw, float *y, int64_t ldy) {
    __m256 a0=_mm256_setzero_ps(),b0=a0,a1=_mm256_setzero_ps(),b1=a1;
    for (int k = 0; k < K; k++) { LOADW B(0) B(1) }
    S(0) S(1)
}
static void tile3(const float *x, int64_t ldx, int K, const float *w, int64_t ldw, float *y, int64_t ldy) {
    __m256 a0=_mm256_setzero_ps(),b0=a0,a1=_mm256_setzero_ps(),b1=a1,a2=_mm256_setzero_ps(),b2=a2;
    for (int k = 0; k < K; k++) { LOADW B(0) B(1) B(2) }
    S(0) S(1) S(2)
}
static void tile4(const float *x, int64_t ldx, int K, const float *w, int64_t ldw, float *y, int64_t ldy) {
    __m256 a0=_mm256_setzero_ps(),b0=a0,a1=_mm256_setzero_ps(),b1=a1,a2=_mm256_setzero_ps(),b2=a2,a3=_mm256_setzero_ps(),b3=a3;
    for (int k = 0; k < K; k++) { LOADW B(0) B(1) B(2) B(3) }
    S(0) S(1) S(2) S(3)
}
static void tile5(const float *x, int64_t ldx, int K, const float *w, int64_t ldw, float *y, int64_t ldy) {
    __m256 a0=_mm256_setzero_ps(),b0=a0,a1=_mm256_setzero_ps(),b1=a1,a2=_mm256_setzero_ps(),b2=a2,a3=_mm256_setzero_ps(),b3=a3,a4=_mm256_setzero_ps(),b4=a4;
    for (int k = 0; k < K; k++) { LOADW B(0) B(1) B(2) B(3) B(4) }
    S(0) S(1) S(2) S(3) S(4)
}
static void tile6(const float *x, int64_t ldx, int K, const float *w, int64_t ldw, float *y, int64_t ldy) {
    __m256 a0=_mm256_setzero_ps(),b0=a0,a1=_mm256_setzero_ps(),b1=a1,a2=_mm256_setzero_ps(),b2=a2,a3=_mm256_setzero_ps(),b3=a3,a4=_mm256_setzero_ps(),b4=a4,a5=_mm256_setzero_ps(),b5=a5;
    for (int k = 0; k < K; k++) { LOADW B(0) B(1) B(2) B(3) B(4) B(5) }
    S(0) S(1) S(2) S(3) S(4) S(5)
}

typedef void (*tile_fn)(const float *, int64_t, int, const float *, int64_t, float *, int64_t);
static const tile_fn TILES[7] = {0, tile1, tile2, tile3, tile4, tile5, tile6};

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times a weight given as N / 16 strips of 16 columns: strip s
   at w + s * sstride, its row k at + k * ldw. Packed W [N, K] (splash.models.packed: [N / 16][K][16]) is
   sstride = 16 K, ldw = 16; a row-major [K, N] weight is sstride = 16, ldw = N. Rows go in blocks whose slice of
   x stays in L2 (<= 192 KiB) while every strip passes over them; up to 6 rows x one strip is one register tile.
   Blocking changes no result: each output element is one dot product in k order. */
static void gemm_strips(const float *x, int64_t M, int K, int64_t ldx, const float *w, int64_t sstride, int64_t ldw,
                        int N, float *y, int64_t ldy) {
    int64_t mb = (49152 / (K > 0 ? K : 1)) / 6 * 6;
    if (mb < 6) mb = 6;
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
        int64_t m1 = m0 + mb < M ? m0 + mb : M;
        for (int s = 0; s < N / 16; s++) {
            const float *ws = w + (int64_t)s * sstride;
            for (int64_t m = m0; m < m1; m += 6) {
                int r = m1 - m < 6 ? (int)(m1 - m) : 6;
                TILES[r](x + m * ldx, ldx, K, ws, ldw, y + m * ldy + 16 * s, ldy);
            }
        }
    }
}

static void gemm_packed(const float *x, int64_t M, int K, int64_t ldx, const float *wp, int N, float *y) {
    gemm_strips(x, M, K, ldx, wp, (int64_t)K * 16, 16, N, y, N);
}

/* One packed weight: y [M, N] = x [M, K] @ W^T (rows of x at stride ldx). */
void linear_packed(const float *x, int64_t M, int K, int64_t ldx, const float *wp, int N, float *y) {
    gemm_packed(x, M, K, ldx, wp, N, y);
}

/* Rows of x [sum(counts), K] grouped by expert -> y [sum(counts), N]; wp [E][N / 16][K][16]. */
void grouped_gemm(const float *x, int K, const int64_t *counts, int E, const float *wp, int N, float *y) {
    int64_t r = 0;
    for (int e = 0; e < E; e++) {
        if (counts[e]) gemm_packed(x + r * K, counts[e], K, K, wp + (int64_t)e * N * K, N, y + r * N);
        r += counts[e];
    }
}

/* e^x for 8 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial (relative error ~2e-7);
   x is clamped to [-87.3, 88.7], so e^-inf gives ~1e-38, not 0 (callers multiply it by sums that are 0 then). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Scores of keys j0 .. j0 + R - 1 of a page against 8 heads: st[j][0..8] = scale * (c_j . q_h + kr_j . qr_h), with
   the queries transposed, qt [d_c + d_r][HP] (HP heads, padded to a multiple of 8). */
#define SC_TILE(RR) static void scores##RR(const float *c, const float *kr, int d_c, int d_r, const float *qt, int HP, \
                                          float scale, float *st) { \
    enum { R = RR }; \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0; \
    for (int d = 0; d < d_c; d++) { __m256 q = _mm256_loadu_ps(qt + (int64_t)d * HP); SC_ROWS(c, d_c) } \
    for (int d = 0; d < d_r; d++) { __m256 q = _mm256_loadu_ps(qt + (int64_t)(d_c + d) * HP); SC_ROWS(kr, d_r) } \
    __m256 sv = _mm256_set1_ps(scale); \
    _mm256_storeu_ps(st, _mm256_mul_ps(a0, sv)); \
    if (R > 1) { _mm256_storeu_ps(st + HP, _mm256_mul_ps(a1, sv)); } \
    if (R > 2) { _mm256_storeu_ps(st + 2 * HP, _mm256_mul_ps(a2, sv)); } \
    if (R > 3) { _mm256_storeu_ps(st + 3 * HP, _mm256_mul_ps(a3, sv)); } \
    if (R > 4) { _mm256_storeu_ps(st + 4 * HP, _mm256_mul_ps(a4, sv)); } \
    if (R > 5) { _mm256_storeu_ps(st + 5 * HP, _mm256_mul_ps(a5, sv)); } }
#define SC_ROWS(K, W) \
    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(K + d), q, a0); \
    if (R > 1) a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(K + W + d), q, a1); \
    if (R > 2) a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(K + 2 * W + d), q, a2); \
    if (R > 3) a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(K + 3 * W + d), q, a3); \
    if (R > 4) a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(K + 4 * W + d), q, a4); \
    if (R > 5) a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(K + 5 * W + d), q, a5);
SC_TILE(1) SC_TILE(2) SC_TILE(3) SC_TILE(4) SC_TILE(5) SC_TILE(6)
typedef void (*sc_fn)(const float *, const float *, int, int, const float *, int, float, float *);
static const sc_fn SCORES[7] = {0, scores1, scores2, scores3, scores4, scores5, scores6};

/* acc[h][i .. i + 16] += sum_j pt[j][h] * c[j][i .. i + 16] for heads h0 .. h0 + R - 1 (pt [nv][HP]). */
#define ACC_TILE(RR) static void accum##RR(const float *pt, int HP, int nv, const float *c, int d_c, float *acc) { \
    enum { R = RR }; \
    __m256 a0 = _mm256_loadu_ps(acc), b0 = _mm256_loadu_ps(acc + 8), a1 = a0, b1 = b0, a2 = a0, b2 = b0, \
           a3 = a0, b3 = b0, a4 = a0, b4 = b0, a5 = a0, b5 = b0; \
    ACC_ALL(LD) \
    for (int j = 0; j < nv; j++) { \
        __m256 w0 = _mm256_loadu_ps(c + (int64_t)j * d_c), w1 = _mm256_loadu_ps(c + (int64_t)j * d_c + 8); \
        const float *pj = pt + (int64_t)j * HP; ACC_ALL(FM) } \
    ACC_ALL(ST) }
#define LD(i) { a##i = _mm256_loadu_ps(acc + (int64_t)(i) * d_c); b##i = _mm256_loadu_ps(acc + (int64_t)(i) * d_c + 8); }
#define FM(i) { __m256 t = _mm256_broadcast_ss(pj + (i)); a##i = _mm256_fmadd_ps(t, w0, a##i); b##i = _mm256_fmadd_ps(t, w1, b##i); }
#define ST(i) { _mm256_storeu_ps(acc + (int64_t)(i) * d_c, a##i); _mm256_storeu_ps(acc + (int64_t)(i) * d_c + 8, b##i); }
#define ACC_ALL(OP) OP(0) if (R > 1) OP(1) if (R > 2) OP(2) if (R > 3) OP(3) if (R > 4) OP(4) if (R > 5) OP(5)
ACC_TILE(1) ACC_TILE(2) ACC_TILE(3) ACC_TILE(4) ACC_TILE(5) ACC_TILE(6)
typedef void (*acc_fn)(const float *, int, int, const float *, int, float *);
static const acc_fn ACCUM[7] = {0, accum1, accum2, accum3, accum4, accum5, accum6};

/* G query rows. For entry g: query row qrow[g] of ql / qr (row r, head h at ql + r * q_rs + h * q_hs, d_c values;
   qr the same strides, d_r values: both may be views into one [n, H, d_c + d_r] tensor); its pages are row prow[g] of
   the page table `pages` [*, P] (physical ids) with `logical` [*, P] (logical block of each), npages[g] of them held
   here; keys at positions <= qpos[g] are visible. Pools: ckv [blocks, bs, d_c], kpe [blocks, bs, d_r].
   Writes o [n, H, d_c] and lse [n, H] (natural log) at row qrow[g]; a row that sees no key gets o = 0, lse = -inf.
   d_c % 16 == 0, d_r % 8 == 0 (d_r may be 0). Per page: the scores of every (key, head) with heads in vector lanes,
   the online-softmax statistics for 8 heads at a time, then the page folded into the running output as a small
   GEMM (heads x 16 latent columns per tile). Returns 0; -1 when scratch cannot be allocated; -2 when a page id
   is outside [0, blocks) or a request claims more than P pages (nothing is read out of bounds). */
int mla_decode(int G, const int64_t *qrow, const int64_t *prow, const int32_t *npages, const int64_t *qpos,
               const int32_t *pages, const int32_t *logical, int64_t P, int64_t blocks, int H, int d_c, int d_r,
               int bs,
               const float *ql, const float *qr, int64_t q_rs, int64_t q_hs, const float *ckv, const float *kpe,
               float scale, float *o, float *lse) {
    int HP = (H + 7) / 8 * 8, D = d_c + d_r;
    float *buf = malloc(sizeof(float) * ((size_t)H * d_c + (size_t)D * HP + 2 * (size_t)bs * HP + 4 * (size_t)HP));
    if (!buf) return -1;
    float *acc = buf, *qt = acc + (size_t)H * d_c, *st = qt + (size_t)D * HP, *pt = st + (size_t)bs * HP;
    float *m = pt + (size_t)bs * HP, *s = m + HP, *al = s + HP;
    for (int g = 0; g < G; g++) {
        if (npages[g] > P) { free(buf); return -2; }
        for (int p = 0; p < npages[g]; p++)
            if (pages[prow[g] * P + p] < 0 || pages[prow[g] * P + p] >= blocks) { free(buf); return -2; }
    }
    for (int g = 0; g < G; g++) {
        const float *qlg = ql + qrow[g] * q_rs, *qrg = qr + qrow[g] * q_rs;
        const int32_t *pg = pages + prow[g] * P, *lg = logical + prow[g] * P;
        memset(qt, 0, sizeof(float) * (size_t)D * HP);
        for (int h = 0; h < H; h++) {
            for (int d = 0; d < d_c; d++) qt[(int64_t)d * HP + h] = qlg[h * q_hs + d];
            for (int d = 0; d < d_r; d++) qt[(int64_t)(d_c + d) * HP + h] = qrg[h * q_hs + d];
        }
        memset(acc, 0, sizeof(float) * (size_t)H * d_c);
        for (int h = 0; h < HP; h++) { m[h] = -INFINITY; s[h] = 0.f; }
        for (int p = 0; p < npages[g]; p++) {
            int64_t base = (int64_t)lg[p] * bs;
            int nv = qpos[g] - base + 1 < bs ? (int)(qpos[g] - base + 1) : bs;
            if (nv <= 0) continue;
            const float *c = ckv + (int64_t)pg[p] * bs * d_c, *kr = kpe + (int64_t)pg[p] * bs * d_r;
            int64_t next = p + 1 < npages[g] ? pg[p + 1] : (g + 1 < G && npages[g + 1] ? pages[prow[g + 1] * P] : -1);
            if (next >= 0) {   /* the next page (or the next request's first) streams in behind this one's math */
                const char *nc = (const char *)(ckv + next * bs * d_c), *nk = (const char *)(kpe + next * bs * d_r);
                for (int64_t off = 0; off < (int64_t)bs * d_c * 4; off += 64) _mm_prefetch(nc + off, _MM_HINT_T0);
                for (int64_t off = 0; off < (int64_t)bs * d_r * 4; off += 64) _mm_prefetch(nk + off, _MM_HINT_T0);
            }
            for (int j = 0; j < nv; j += 6) {
                int r = nv - j < 6 ? nv - j : 6;
                for (int hv = 0; hv < HP; hv += 8)
                    SCORES[r](c + (int64_t)j * d_c, kr + (int64_t)j * d_r, d_c, d_r, qt + hv, HP, scale,
                              st + (int64_t)j * HP + hv);
            }
            for (int hv = 0; hv < HP; hv += 8) {
                __m256 mx = _mm256_loadu_ps(m + hv), mo = mx;
                for (int j = 0; j < nv; j++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(st + (int64_t)j * HP + hv));
                __m256 alpha = exp8(_mm256_sub_ps(mo, mx)), sum = _mm256_setzero_ps();
                for (int j = 0; j < nv; j++) {
                    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(st + (int64_t)j * HP + hv), mx));
                    _mm256_storeu_ps(pt + (int64_t)j * HP + hv, e);
                    sum = _mm256_add_ps(sum, e);
                }
                _mm256_storeu_ps(s + hv, _mm256_fmadd_ps(_mm256_loadu_ps(s + hv), alpha, sum));
                _mm256_storeu_ps(m + hv, mx);
                _mm256_storeu_ps(al + hv, alpha);
            }
            for (int h = 0; h < H; h++) {   /* rescale the running output by each head's alpha */
                __m256 a = _mm256_set1_ps(al[h]);
                for (int i = 0; i < d_c; i += 8)
                    _mm256_storeu_ps(acc + h * d_c + i, _mm256_mul_ps(_mm256_loadu_ps(acc + h * d_c + i), a));
            }
            for (int i = 0; i < d_c; i += 16)
                for (int h = 0; h < H; h += 6) {
                    int r = H - h < 6 ? H - h : 6;
                    ACCUM[r](pt + h, HP, nv, c + i, d_c, acc + (int64_t)h * d_c + i);
                }
        }
        float *og = o + qrow[g] * H * d_c, *lsg = lse + qrow[g] * H;
        for (int h = 0; h < H; h++) {
            if (m[h] > -INFINITY) {
                __m256 inv = _mm256_set1_ps(1.f / s[h]);
                for (int i = 0; i < d_c; i += 8)
                    _mm256_storeu_ps(og + h * d_c + i, _mm256_mul_ps(_mm256_loadu_ps(acc + h * d_c + i), inv));
                lsg[h] = m[h] + logf(s[h]);
            } else {
                memset(og + h * d_c, 0, sizeof(float) * d_c);
                lsg[h] = -INFINITY;
            }
        }
    }
    free(buf);
    return 0;
}

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
static void rope_to(const float *x, int64_t n, int64_t H, int64_t sn, int64_t sh, int dim, int interleave,
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

/* MLA's absorbed queries q~ [n, H, d_c + d_r] (contiguous) from Q-B's output q [n, H, qk] (row stride ldq, heads
   qk apart; per head q_nope = the first d_nope values, q_rope the next d_r) and W_UK [H, d_nope, d_c]: per head a
   GEMM q_nope @ W_UK[h] (W_UK[h] row-major [d_nope, d_c]: 16-column strips read in place) written into q~'s
   latent part, and q_rope rotated (rope_to) into its rope part: no transposes, no concatenation. d_c % 16 == 0. */
void absorb_rope(const float *q, int64_t n, int H, int64_t ldq, int qk, int d_nope, const float *wuk, int d_c,
                 int d_r, int interleave, const float *cos, const float *sin, float *out) {
    int64_t D = d_c + d_r;
    for (int h = 0; h < H; h++)
        gemm_strips(q + (int64_t)h * qk, n, d_nope, ldq, wuk + (int64_t)h * d_nope * d_c, 16, d_c, d_c,
                    out + h * D, H * D);
    if (d_r) rope_to(q + d_nope, n, H, ldq, qk, d_r, interleave, cos, sin, out + d_c, H * D, D);
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

/* out [n, d] = sum over rows i of ys [m, d] with tok[i] = r of w[i] * ys[i] (a product, then a sum, in i order:
   what mul_ then index_add_ into zeros compute). d % 8 == 0. */
void moe_combine(const float *ys, int64_t m, int d, const int64_t *tok, const float *w, int64_t n, float *out) {
    memset(out, 0, sizeof(float) * (size_t)n * d);
    for (int64_t i = 0; i < m; i++) {
        float *o = out + tok[i] * d;
        const float *y = ys + i * d;
        __m256 wv = _mm256_set1_ps(w[i]);
        for (int c = 0; c < d; c += 8)
            _mm256_storeu_ps(o + c, _mm256_add_ps(_mm256_loadu_ps(o + c), _mm256_mul_ps(wv, _mm256_loadu_ps(y + c))));
    }
}

/* W_UV per head: o [n, H * d_v] with o[r, h d_v .. (h + 1) d_v] = ol[r, h] @ W_UV^T[h], ol [n, H, d_c] contiguous,
   W_UV^T [H, d_c, d_v] row-major (16-column strips read in place). d_v % 16 == 0. */
void uv_heads(const float *ol, int64_t n, int H, int d_c, const float *wuvt, int d_v, float *out) {
    for (int h = 0; h < H; h++)
        gemm_strips(ol + (int64_t)h * d_c, n, d_c, (int64_t)H * d_c, wuvt + (int64_t)h * d_c * d_v, 16, d_v, d_v,
                    out + (int64_t)h * d_v, (int64_t)H * d_v);
}

/* MLA's projections of n rows up to the attention, one call (each step as its own kernel computes it). `parts`:
   1 the queries, 2 the new latent KV, 3 both; `wa` the packed Q-A (1), KV-A (2) or [Q-A ; KV-A] (3) weight. Queries:
   qa = RMSNorm(x @ Q-A^T) (written out: DSA's indexer reads it), q = qa @ Q-B^T (packed, H qk columns), q~ =
   absorb_rope(q) [n, H, d_c + d_r]. Latent: c = RMSNorm of the latent part of x @ KV-A^T [n, d_c], kpe = RoPE of its
   rope part [n, d_r]. q_lora % 8 == 0, d_c % 16 == 0. Returns 0, or -1 when scratch cannot be allocated. */
int mla_project(const float *x, int64_t n, int hidden, int64_t ldx, int parts, const float *wa, int q_lora,
                const float *q_a_norm, const float *q_b, int H, int qk, int d_nope, const float *wuk, int d_c, int d_r,
                const float *kv_a_norm, float eps, int interleave, const float *cos, const float *sin, float *qa,
                float *qt, float *c, float *kpe) {
    int qw = parts & 1 ? q_lora : 0, W = qw + (parts & 2 ? d_c + d_r : 0);
    float *h = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1) * (W + (parts & 1 ? (int64_t)H * qk : 0)));
    if (!h) return -1;
    gemm_packed(x, n, hidden, ldx, wa, W, h);
    if (parts & 1) {
        float *q = h + n * W;
        rms_norm(h, n, q_lora, W, q_a_norm, eps, qa);
        gemm_packed(qa, n, q_lora, q_lora, q_b, H * qk, q);
        absorb_rope(q, n, H, (int64_t)H * qk, qk, d_nope, wuk, d_c, d_r, interleave, cos, sin, qt);
    }
    if (parts & 2) {
        rms_norm(h + qw, n, d_c, W, kv_a_norm, eps, c);
        if (d_r) rope_to(h + qw + d_c, n, 1, W, 0, d_r, interleave, cos, sin, kpe, d_r, 0);
    }
    free(h);
    return 0;
}

/* A SwiGLU MLP on packed weights, one call: y [M, N] = swiglu(x [M, K] @ GU^T) @ D^T, GU [2 I, K] = [gate ; up] and
   D [N, I] packed; rows in blocks of 64 so the intermediate [64, 3 I] scratch stays in cache. The same products,
   sums and activation as linear_packed, swiglu, linear_packed. Returns 0, or -1 when scratch cannot be
   allocated. I % 8 == 0. */
int mlp_packed(const float *x, int64_t M, int K, int64_t ldx, const float *gu, int I, const float *d, int N, float *y) {
    int64_t mb = M < 64 ? M : 64;
    float *h = malloc(sizeof(float) * (size_t)(mb > 0 ? mb : 1) * 3 * I);
    if (!h) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
        int64_t r = M - m0 < mb ? M - m0 : mb;
        gemm_packed(x + m0 * ldx, r, K, ldx, gu, 2 * I, h);
        swiglu(h, r, I, 2 * I, h + r * 2 * I);
        gemm_packed(h + r * 2 * I, r, I, I, d, N, y + m0 * N);
    }
    free(h);
    return 0;
}

/* The routed experts of a MoE layer, one call: for each expert e with counts[e] rows (rows sorted by expert: token
   tok[i], weight w[i] of sorted row i), gather its tokens' rows of x [n, K], run the packed SwiGLU MLP of expert e
   (gate_up [E][2 I / 16][K][16], down [E][N / 16][I][16]), and add w[i] times each result row to out [n, N], which
   is zeroed first: what index_select, two grouped GEMMs, swiglu and moe_combine compute, in the same order.
   Returns 0, or -1 when scratch cannot be allocated or a token is outside [0, n). */
int moe_experts(const float *x, int64_t n, int K, const int64_t *tok, const int64_t *counts, const float *w, int E,
                const float *gate_up, int I, const float *down, int N, float *out) {
    int64_t most = 1, r = 0;
    for (int e = 0; e < E; e++) { most = counts[e] > most ? counts[e] : most; r += counts[e]; }
    for (int64_t i = 0; i < r; i++) if (tok[i] < 0 || tok[i] >= n) return -1;
    float *xs = malloc(sizeof(float) * (size_t)most * (K + 3 * I + N));
    if (!xs) return -1;
    float *h = xs + most * K, *a = h + most * 2 * I, *ys = a + most * I;
    memset(out, 0, sizeof(float) * (size_t)n * N);
    r = 0;
    for (int e = 0; e < E; e++) {
        int64_t c = counts[e];
        if (!c) continue;
        for (int64_t i = 0; i < c; i++) memcpy(xs + i * K, x + tok[r + i] * K, sizeof(float) * K);
        gemm_packed(xs, c, K, K, gate_up + (int64_t)e * 2 * I * K, 2 * I, h);
        swiglu(h, c, I, 2 * I, a);
        gemm_packed(a, c, I, I, down + (int64_t)e * N * I, N, ys);
        for (int64_t i = 0; i < c; i++) {
            float *o = out + tok[r + i] * N;
            const float *y = ys + i * N;
            __m256 wv = _mm256_set1_ps(w[r + i]);
            for (int j = 0; j < N; j += 8)
                _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_mul_ps(wv, _mm256_loadu_ps(y + j))));
        }
        r += c;
    }
    free(xs);
    return 0;
}
