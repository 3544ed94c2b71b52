/* fp32 products with few rows for the CPU decode steps (see small_gemm.py).
 *
 * C = X W^T + b for X with a handful of rows (8-32 in a decode step) and a weight W (n x k) reused
 * for a whole sampling call. W is packed once into column panels: panel p holds, for each of the k
 * inputs, the NR weights of outputs p*NR .. p*NR + NR - 1 side by side (zero past n), so the kernel
 * streams each panel front to back. Per panel, every block of up to 4 rows keeps 4 x 24 sums in 12
 * AVX2 registers and adds one input column per step with fused multiply-adds; a row's sums run
 * over k in order, the same whatever the number of rows, so a row's result does not depend on the
 * batch it is in.
 *
 * Built with -mavx2 -mfma; the loader checks that the CPU has both before it loads the library.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 24
#define PREFETCH_ROWS 16 /* panel rows ahead: measured best of 8/16/32/64 on an AVX2 EPYC */

/* w: n x k (row stride ldw), out: ceil(n / NR) * k * NR floats, 32-byte aligned. */
void comlrl_pack_panels(const float *w, int64_t n, int64_t k, int64_t ldw, float *out) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * NR;
        for (int64_t j = 0; j < NR; j++) {
            int64_t row = p * NR + j;
            if (row < n) {
                const float *src = w + row * ldw;
                for (int64_t i = 0; i < k; i++) dst[i * NR + j] = src[i];
            } else {
                for (int64_t i = 0; i < k; i++) dst[i * NR + j] = 0.0f;
            }
        }
    }
}

#define ROW_INIT(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps(), c##r##2 = _mm256_setzero_ps();
#define ROW_FMA(r) { __m256 a = _mm256_broadcast_ss(x + (r) * ldx + i); \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0); \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1); \
    c##r##2 = _mm256_fmadd_ps(a, b2, c##r##2); }
#define ROW_STORE(r) { float *dst = c + (r) * ldc; \
    if (bias) { \
        c##r##0 = _mm256_add_ps(c##r##0, _mm256_loadu_ps(bias)); \
        c##r##1 = _mm256_add_ps(c##r##1, _mm256_loadu_ps(bias + 8)); \
        c##r##2 = _mm256_add_ps(c##r##2, _mm256_loadu_ps(bias + 16)); \
    } \
    if (cols == NR) { \
        _mm256_storeu_ps(dst, c##r##0); _mm256_storeu_ps(dst + 8, c##r##1); _mm256_storeu_ps(dst + 16, c##r##2); \
    } else { \
        float tmp[NR]; \
        _mm256_storeu_ps(tmp, c##r##0); _mm256_storeu_ps(tmp + 8, c##r##1); _mm256_storeu_ps(tmp + 16, c##r##2); \
        memcpy(dst, tmp, (size_t)cols * sizeof(float)); \
    } }

/* Rows x[0 .. R-1] times one panel: c[r][0 .. cols-1] = sum_i x[r][i] * panel[i][.] (+ bias). */
#define KERNEL(NAME, INIT, FMA, STORE) \
static void NAME(int64_t k, const float *x, int64_t ldx, const float *panel, const float *bias, \
                 float *c, int64_t ldc, int cols) { \
    INIT \
    for (int64_t i = 0; i < k; i++) { \
        const float *row = panel + i * NR; \
        _mm_prefetch((const char *)(row + PREFETCH_ROWS * NR), _MM_HINT_T0); \
        __m256 b0 = _mm256_load_ps(row), b1 = _mm256_load_ps(row + 8), b2 = _mm256_load_ps(row + 16); \
        FMA \
    } \
    STORE \
}

KERNEL(rows4, ROW_INIT(0) ROW_INIT(1) ROW_INIT(2) ROW_INIT(3),
       ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3), ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3))
KERNEL(rows3, ROW_INIT(0) ROW_INIT(1) ROW_INIT(2), ROW_FMA(0) ROW_FMA(1) ROW_FMA(2),
       ROW_STORE(0) ROW_STORE(1) ROW_STORE(2))
KERNEL(rows2, ROW_INIT(0) ROW_INIT(1), ROW_FMA(0) ROW_FMA(1), ROW_STORE(0) ROW_STORE(1))
KERNEL(rows1, ROW_INIT(0), ROW_FMA(0), ROW_STORE(0))

/* For each of `batch` (x, packed weight, bias, c): c (m x n, row stride ldc) = x (m x k, row stride
 * ldx) times the packed weight, plus bias (padded to whole panels; NULL for none). */
void comlrl_panel_gemm(int64_t batch, int64_t m, int64_t n, int64_t k,
                       const float *x, int64_t x_batch_stride, int64_t ldx,
                       const float *packed, int64_t packed_batch_stride,
                       const float *bias, int64_t bias_batch_stride,
                       float *c, int64_t c_batch_stride, int64_t ldc) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t a = 0; a < batch; a++) {
        const float *xa = x + a * x_batch_stride, *wa = packed + a * packed_batch_stride;
        const float *ba = bias ? bias + a * bias_batch_stride : 0;
        float *ca = c + a * c_batch_stride;
        for (int64_t p = 0; p < panels; p++) {
            int64_t c0 = p * NR;
            int cols = n - c0 < NR ? (int)(n - c0) : NR;
            const float *panel = wa + p * k * NR, *b = ba ? ba + c0 : 0;
            int64_t r = 0;
            for (; r + 4 <= m; r += 4) rows4(k, xa + r * ldx, ldx, panel, b, ca + r * ldc + c0, ldc, cols);
            switch (m - r) {
                case 3: rows3(k, xa + r * ldx, ldx, panel, b, ca + r * ldc + c0, ldc, cols); break;
                case 2: rows2(k, xa + r * ldx, ldx, panel, b, ca + r * ldc + c0, ldc, cols); break;
                case 1: rows1(k, xa + r * ldx, ldx, panel, b, ca + r * ldc + c0, ldc, cols); break;
                default: break;
            }
        }
    }
}
