/* SPLASH's CPU GEMMs over packed weights (splash.native.packed: strips of 16 output columns, each [K][16]
   input-major, so a strip streams from memory once and stays in L1 while every row tile reads it; tiles of up to
   6 rows x 16 columns keep 12 accumulators in registers). Each output element is one dot product in k order: a
   row's result does not depend on which other rows share the call.

   linear_packed: one packed weight. grouped_gemm: the MoE experts' GEMMs over rows sorted by expert.
   mlp_packed: a packed SwiGLU MLP in one call. moe_experts: a MoE layer's routed experts (gather, both GEMMs,
   SwiGLU, weighted sum) in one call. */
#include "kernels.h"

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
   at w + s * sstride, its row k at + k * ldw. Packed W [N, K] (splash.native.packed: [N / 16][K][16]) is
   sstride = 16 K, ldw = 16; a row-major [K, N] weight is sstride = 16, ldw = N. Rows go in blocks whose slice of
   x stays in L2 (<= 192 KiB) while every strip passes over them; up to 6 rows x one strip is one register tile.
   Blocking changes no result: each output element is one dot product in k order. */
void gemm_strips(const float *x, int64_t M, int K, int64_t ldx, const float *w, int64_t sstride, int64_t ldw,
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

void gemm_packed(const float *x, int64_t M, int K, int64_t ldx, const float *wp, int N, float *y) {
    gemm_strips(x, M, K, ldx, wp, (int64_t)K * 16, 16, N, y, N);
}

/* One packed weight: y [M, N] = x [M, K] @ W^T (rows of x at stride ldx). */
void linear_packed(const float *x, int64_t M, int K, int64_t ldx, const float *wp, int N, float *y) {
    gemm_packed(x, M, K, ldx, wp, N, y);
}

/* Rows of x [sum(counts), K] grouped by expert -> y [sum(counts), N]; wp [E][N / 16][K][16]. Returns 0, or -1
   (nothing computed) when a count is negative or they sum past x's M rows. */
int grouped_gemm(const float *x, int64_t M, int K, const int64_t *counts, int E, const float *wp, int N, float *y) {
    int64_t r = 0;
    for (int e = 0; e < E; e++) {
        if (counts[e] < 0) return -1;
        r += counts[e];
    }
    if (r > M) return -1;
    r = 0;
    for (int e = 0; e < E; e++) {
        if (counts[e]) gemm_packed(x + r * K, counts[e], K, K, wp + (int64_t)e * N * K, N, y + r * N);
        r += counts[e];
    }
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
   is zeroed first: what index_select, two grouped GEMMs, swiglu and the weighted index_add compute, in the same order.
   tok and w have m entries. Returns 0; -1 when scratch cannot be allocated; -2 when a count is negative or they do
   not sum to m; -3 when a token is outside [0, n) (the last two before anything is read through them). */
int moe_experts(const float *x, int64_t n, int K, const int64_t *tok, int64_t m, const int64_t *counts,
                const float *w, int E, const float *gate_up, int I, const float *down, int N, float *out) {
    int64_t most = 1, r = 0;
    for (int e = 0; e < E; e++) {
        if (counts[e] < 0) return -2;
        most = counts[e] > most ? counts[e] : most;
        r += counts[e];
    }
    if (r != m) return -2;
    for (int64_t i = 0; i < r; i++) if (tok[i] < 0 || tok[i] >= n) return -3;
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
