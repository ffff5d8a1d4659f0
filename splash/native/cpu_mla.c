/* SPLASH's CPU kernels for MLA (absorbed form).

   mla_decode: attention of query rows over the paged latent cache, read in place through the page table: one entry
   per row (a decode row, or one row of a prefill chunk, which sees the keys up to its own position); per entry,
   page by page, scores of every head against the page's visible keys, then an online-softmax fold of the page into
   a running (max, sum, output) per head. Scratch is heads x (d_c + block) floats per call, whatever the batch and
   context.

   absorb_rope, uv_heads, mla_project: the per-head GEMMs around the attention (q_nope @ W_UK with the rotated
   q_rope into the absorbed queries; õ @ W_UV^T into O's input), reading the per-head weights in place, and a
   layout's projections up to the attention in one call. */
#include "kernels.h"

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
   GEMM (heads x 16 latent columns per tile). Every index is checked before anything is read through it: returns 0;
   -1 when scratch cannot be allocated; -2 when a page id is outside [0, blocks) or a request claims more than P
   pages; -3 when a query row is outside [0, n); -4 when a page-table row is outside [0, R). */
int mla_decode(int G, const int64_t *qrow, int64_t n, const int64_t *prow, int64_t R, const int32_t *npages,
               const int64_t *qpos, const int32_t *pages, const int32_t *logical, int64_t P, int64_t blocks, int H,
               int d_c, int d_r, int bs,
               const float *ql, const float *qr, int64_t q_rs, int64_t q_hs, const float *ckv, const float *kpe,
               float scale, float *o, float *lse) {
    int HP = (H + 7) / 8 * 8, D = d_c + d_r;
    for (int g = 0; g < G; g++) {
        if (qrow[g] < 0 || qrow[g] >= n) return -3;
        if (prow[g] < 0 || prow[g] >= R) return -4;
    }
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
