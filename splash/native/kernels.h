/* Declarations shared by SPLASH's CPU kernels (cpu_gemm.c, cpu_rows.c, cpu_mla.c: x86-64 AVX2 + FMA, fp32, one
   thread), built together into one library by splash/native/__init__.py; called only from splash/native/ops.py,
   which checks every argument's dtype, device, shape and strides first. Index values (pages, rows, experts, tokens,
   counts) are checked here, against the bounds passed in, before anything is read through them. */
#ifndef SPLASH_KERNELS_H
#define SPLASH_KERNELS_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* cpu_gemm.c */
void gemm_strips(const float *x, int64_t M, int K, int64_t ldx, const float *w, int64_t sstride, int64_t ldw, int N,
                 float *y, int64_t ldy);
void gemm_packed(const float *x, int64_t M, int K, int64_t ldx, const float *wp, int N, float *y);
/* cpu_rows.c */
void rms_norm(const float *x, int64_t n, int d, int64_t ldx, const float *w, float eps, float *y);
void rope_to(const float *x, int64_t n, int64_t H, int64_t sn, int64_t sh, int dim, int interleave, const float *cos,
             const float *sin, float *y, int64_t yn, int64_t yh);
void swiglu(const float *h, int64_t n, int d, int64_t ldh, float *y);
/* cpu_mla.c */
void absorb_rope(const float *q, int64_t n, int H, int64_t ldq, int qk, int d_nope, const float *wuk, int d_c,
                 int d_r, int interleave, const float *cos, const float *sin, float *out);
#endif
