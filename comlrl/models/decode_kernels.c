/* fp32 products with few rows for the CPU decode steps (see decode_kernels.py).
 *
 * C = X W^T + b for X with a handful of rows (8-32 in a decode step) and a weight W (n x k) reused
 * for a whole sampling call. W is packed once into column panels: panel p holds, for each of the k
 * inputs, the NR = 8 weights of outputs p*NR .. p*NR + NR - 1 side by side (zero past n), so the
 * kernel streams each panel front to back, once per block of up to 8 rows, which keeps 8 x 8 sums
 * in 8 AVX2 registers and adds one input column per step with fused multiply-adds. (Measured
 * against 4 rows x 24 outputs, which reads each panel twice for 8 rows: one medium-model step's
 * projections, weights out of cache, 1.54 -> 1.30 ms with 8 rows per agent, 3.1-3.6 -> 2.5 ms with
 * 16.) A row's sums run over k in order, the same whatever the number of rows, so a row's result
 * does not depend on the batch it is in. 16-wide panels (below) are now the default; they give the
 * same results bit for bit.
 *
 * Built with -mavx2 -mfma; the loader checks that the CPU has both before it loads the library, and
 * uses the AVX-512 kernels below only where torch reports AVX-512.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define NR 8
#define NR16 16
#define NR6 6
#define PREFETCH_ROWS 64 /* panel rows ahead (2 KB): measured best of 16/32/64/128 on an AVX2 EPYC */

/* t[0 .. 7] = the 8 x 8 block r[0 .. 7] transposed (t[i][j] = r[j][i]). */
static inline void transpose8x8(const __m256 r[8], __m256 t[8]) {
    __m256 a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        a[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm256_shuffle_ps(a[i], a[i + 2], 0x44);
        b[i + 1] = _mm256_shuffle_ps(a[i], a[i + 2], 0xEE);
        b[i + 2] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0x44);
        b[i + 3] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(b[i], b[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(b[i], b[i + 4], 0x31);
    }
}

/* Weight row r (k floats) at address rows[r] for r < n, each column i times scale[i] when `scale`
 * is not NULL (an RMSNorm's weight folded in: the product rounded once, as torch.mul rounds it);
 * out: ceil(n / width) * k * width floats, 64-byte aligned; width is NR6 or NR (AVX2 kernels) or
 * NR16 (AVX-512 kernels, or AVX2 ones). Reading rows through addresses packs a projection straight from its
 * parameters, whatever order or tensors its rows come from (the QKV projection's reordered query
 * and key rows, then the values), without first joining them into one weight (one copy of the
 * QKV, gate/up and LM head weights fewer per sampling call). Each panel is written front to back,
 * reading its `width` weight rows side by side (one pass of sequential reads and writes; row by
 * row, each panel line was written `width` times, ~2x slower). Whole panels go 8 inputs x 8
 * outputs at a time through an in-register transpose (both agents' medium-model weights, warm:
 * 3.1-3.7 -> 1.8-2.3 ms); the last panel's missing outputs and inputs past a multiple of 8 element
 * by element. */
void comlrl_pack_panels(const int64_t *rows, const float *scale, int64_t n, int64_t k, float *out, int64_t width) {
    int64_t panels = (n + width - 1) / width;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * width;
        int64_t count = n - p * width < width ? n - p * width : width;
        const float *src[NR16];
        for (int64_t j = 0; j < count; j++) src[j] = (const float *)(intptr_t)rows[p * width + j];
        int64_t i = 0;
        if (count == width && width == NR6)
            for (; i + 8 <= k; i += 8) {
                /* 8 inputs of the panel's 6 rows (and 2 copies of its last), transposed: 6 floats per line */
                const __m256 factor = scale ? _mm256_loadu_ps(scale + i) : _mm256_set1_ps(1.0f);
                __m256 block[8], transposed[8];
                for (int r = 0; r < 8; r++) block[r] = _mm256_loadu_ps(src[r < NR6 ? r : NR6 - 1] + i);
                if (scale)
                    for (int r = 0; r < 8; r++) block[r] = _mm256_mul_ps(block[r], factor);
                transpose8x8(block, transposed);
                for (int r = 0; r < 8; r++) {
                    float *line = dst + (i + r) * NR6;
                    _mm_storeu_ps(line, _mm256_castps256_ps128(transposed[r]));
                    _mm_storel_pi((__m64 *)(line + 4), _mm256_extractf128_ps(transposed[r], 1));
                }
            }
        if (count == width && width % 8 == 0)
            for (; i + 8 <= k; i += 8) {
                const __m256 factor = scale ? _mm256_loadu_ps(scale + i) : _mm256_set1_ps(1.0f);
                for (int64_t j = 0; j < width; j += 8) {
                    __m256 block[8], transposed[8];
                    for (int r = 0; r < 8; r++) block[r] = _mm256_loadu_ps(src[j + r] + i);
                    if (scale)
                        for (int r = 0; r < 8; r++) block[r] = _mm256_mul_ps(block[r], factor);
                    transpose8x8(block, transposed);
                    for (int r = 0; r < 8; r++) _mm256_storeu_ps(dst + (i + r) * width + j, transposed[r]);
                }
            }
        for (; i < k; i++) {
            float *line = dst + i * width;
            int64_t j = 0;
            for (; j < count; j++) line[j] = scale ? src[j][i] * scale[i] : src[j][i];
            for (; j < width; j++) line[j] = 0.0f;
        }
    }
}

/* Row r's 8 sums of one panel live in register c<r>; each input column adds x[r][i] * panel row i. */
#define ROW_INIT(r) __m256 c##r = _mm256_setzero_ps();
#define ROW_FMA(r) c##r = _mm256_fmadd_ps(_mm256_broadcast_ss(xi + (r)), b, c##r);
#define ROW_STORE(r) { \
    float *dst = c + (r) * ldc; \
    if (bias) c##r = _mm256_add_ps(c##r, _mm256_loadu_ps(bias)); \
    if (cols == NR) { \
        _mm256_storeu_ps(dst, c##r); \
    } else { \
        float tmp[NR]; \
        _mm256_storeu_ps(tmp, c##r); \
        memcpy(dst, tmp, (size_t)cols * sizeof(float)); \
    } }

/* Rows x[0 .. R-1] times one panel of WIDTH outputs: c[r][0 .. cols-1] = sum_i x[r][i] * panel[i][.]
 * (+ bias), the panel read front to back with a prefetch AHEAD panel rows ahead; with `next` (not
 * NULL), also panel row i of the panel at `next` fetched into L2 (a row block that finds its own
 * panel in L1 has the memory system to spare); SETUP, INIT, FMA and STORE are the family's (b: the
 * panel row in a register). */
#define PANEL_KERNEL(NAME, ATTR, VEC, LOAD, WIDTH, AHEAD, SETUP, INIT, FMA, STORE) \
static ATTR void NAME(int64_t k, const float *xt, int64_t ldt, const float *panel, const float *bias, \
                      float *c, int64_t ldc, int cols, const float *next) { \
    SETUP \
    INIT \
    for (int64_t i = 0; i < k; i++) { \
        const float *row = panel + i * WIDTH, *xi = xt + i * ldt; \
        _mm_prefetch((const char *)(row + AHEAD * WIDTH), _MM_HINT_T0); \
        if (next) _mm_prefetch((const char *)(next + i * WIDTH), _MM_HINT_T1); \
        VEC b = LOAD(row); \
        FMA \
    } \
    STORE \
}
#define NO_ATTR
#define KERNEL(NAME, INIT, FMA, STORE) \
    PANEL_KERNEL(NAME, NO_ATTR, __m256, _mm256_load_ps, NR, PREFETCH_ROWS, , INIT, FMA, STORE)

/* Row lists: R8(M) is M(0) ... M(7). A family's kernels for 8, 4, 3, 2 and 1 rows. */
#define R16(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define R8(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#define R4(M) M(0) M(1) M(2) M(3)
#define R3(M) M(0) M(1) M(2)
#define R2(M) M(0) M(1)
#define R1(M) M(0)
#define ROW_KERNELS(FAMILY, INIT, FMA, STORE, N8, N4, N3, N2, N1) \
    FAMILY(N8, R8(INIT), R8(FMA), R8(STORE)) FAMILY(N4, R4(INIT), R4(FMA), R4(STORE)) \
    FAMILY(N3, R3(INIT), R3(FMA), R3(STORE)) FAMILY(N2, R2(INIT), R2(FMA), R2(STORE)) \
    FAMILY(N1, R1(INIT), R1(FMA), R1(STORE))
ROW_KERNELS(KERNEL, ROW_INIT, ROW_FMA, ROW_STORE, rows8, rows4, rows3, rows2, rows1)

/* The same on AVX-512 CPUs: 16-wide panels (one cache line per input), up to 16 rows per pass
 * (16 of the 32 registers hold sums), so at the decode step's 16 rows per agent each panel is read
 * once. Each sum runs over k in the same order, one fused multiply-add at a time, so the results
 * equal the AVX2 kernels' bit for bit. */
#define PREFETCH_ROWS16 32 /* 2 KB ahead, as above */
#define AVX512 __attribute__((target("avx512f")))
#define ROW16_INIT(r) __m512 c##r = _mm512_setzero_ps();
#define ROW16_FMA(r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(xi[r]), b, c##r);
#define ROW16_STORE(r) { \
    if (bias) c##r = _mm512_add_ps(c##r, _mm512_loadu_ps(bias)); \
    _mm512_mask_storeu_ps(c + (r) * ldc, mask, c##r); }
#define KERNEL16(NAME, INIT, FMA, STORE) \
    PANEL_KERNEL(NAME, AVX512, __m512, _mm512_loadu_ps, NR16, PREFETCH_ROWS16, \
                 const __mmask16 mask = (__mmask16)((1u << cols) - 1u);, INIT, FMA, STORE)
KERNEL16(rows16x16, R16(ROW16_INIT), R16(ROW16_FMA), R16(ROW16_STORE))
ROW_KERNELS(KERNEL16, ROW16_INIT, ROW16_FMA, ROW16_STORE, rows8x16, rows4x16, rows3x16, rows2x16, rows1x16)

/* AVX2 with 16-wide panels (the AVX-512 packing): row r's 16 sums in two registers, c<r>l and
 * c<r>h, so 6 rows keep 12 sums in flight and each input column costs 2 panel loads and 6
 * broadcasts per 12 fused multiply-adds, where the 8-wide kernel pays 1 + 8 per 8 and keeps only
 * 8 in flight, as many as the FMA units' latency needs, with no slack. Same order of sums, so the
 * same results bit for bit. Measured on an AVX2 EPYC (Zen 3), medium model, 2 agents, in C with
 * every weight of a step streamed from L3 in turn, as a real step does: one step's projections
 * 1.95 -> 1.75 ms at 16 rows per agent (6 + 6 + 4), even at 8 (4 + 4: each panel read twice, the
 * first time from L3); one sampling call's products 165 -> 148 ms (K=8) and 97 -> 91 ms (K=4,
 * with the prefill's 6-row blocks: ~114 prompt rows 62 -> 78 GFLOP/s, MKL's rate there). */
#define PREFETCH_ROWS2 96 /* 6 KB ahead: of 16-256, 96-128 was best; 16 lost 25% at 8 rows */
#define ROW2_INIT(r) __m256 c##r##l = _mm256_setzero_ps(); __m256 c##r##h = _mm256_setzero_ps();
#define ROW2_FMA(r) { const __m256 xr = _mm256_broadcast_ss(xi + (r)); \
    c##r##l = _mm256_fmadd_ps(xr, b, c##r##l); c##r##h = _mm256_fmadd_ps(xr, b_high, c##r##h); }
#define ROW2_STORE(r) { \
    float *dst = c + (r) * ldc; \
    if (bias) { c##r##l = _mm256_add_ps(c##r##l, _mm256_loadu_ps(bias)); \
                c##r##h = _mm256_add_ps(c##r##h, _mm256_loadu_ps(bias + NR)); } \
    if (cols == NR16) { \
        _mm256_storeu_ps(dst, c##r##l); _mm256_storeu_ps(dst + NR, c##r##h); \
    } else { \
        float tmp[NR16]; \
        _mm256_storeu_ps(tmp, c##r##l); _mm256_storeu_ps(tmp + NR, c##r##h); \
        memcpy(dst, tmp, (size_t)cols * sizeof(float)); \
    } }
#define KERNEL2(NAME, INIT, FMA, STORE) \
    PANEL_KERNEL(NAME, NO_ATTR, __m256, _mm256_load_ps, NR16, PREFETCH_ROWS2, , INIT, \
                 const __m256 b_high = _mm256_load_ps(row + NR); FMA, STORE)
#define R6(M) M(0) M(1) M(2) M(3) M(4) M(5)
KERNEL2(rows6w16, R6(ROW2_INIT), R6(ROW2_FMA), R6(ROW2_STORE))
KERNEL2(rows4w16, R4(ROW2_INIT), R4(ROW2_FMA), R4(ROW2_STORE))
KERNEL2(rows3w16, R3(ROW2_INIT), R3(ROW2_FMA), R3(ROW2_STORE))
KERNEL2(rows2w16, R2(ROW2_INIT), R2(ROW2_FMA), R2(ROW2_STORE))
KERNEL2(rows1w16, R1(ROW2_INIT), R1(ROW2_FMA), R1(ROW2_STORE))

/* The statements that run one panel against rows r .. m - 1 (the driver's locals below): the
 * family's widest kernel's blocks, then blocks of 8 and 4, then the last 1-3 rows. */
#define ROW_BLOCKS(BLOCK, BLOCK_KERNEL, K8, K4, K3, K2, K1) \
    for (; r + BLOCK <= m; r += BLOCK) BLOCK_KERNEL(k, xt + r, m, panel, b, ca + r * ldc + c0, ldc, cols, 0); \
    for (; r + 8 <= m; r += 8) K8(k, xt + r, m, panel, b, ca + r * ldc + c0, ldc, cols, 0); \
    for (; r + 4 <= m; r += 4) K4(k, xt + r, m, panel, b, ca + r * ldc + c0, ldc, cols, 0); \
    switch (m - r) { \
        case 3: K3(k, xt + r, m, panel, b, ca + r * ldc + c0, ldc, cols, 0); break; \
        case 2: K2(k, xt + r, m, panel, b, ca + r * ldc + c0, ldc, cols, 0); break; \
        case 1: K1(k, xt + r, m, panel, b, ca + r * ldc + c0, ldc, cols, 0); break; \
        default: break; \
    }
/* The AVX2 16-wide family: blocks of 6 rows, but 7 or 8 left go as 4 + 3 or 4 + 4 (a block of
 * 1-2 rows keeps too few sums in flight): 16 rows are 6 + 6 + 4, 8 rows 4 + 4. The first block
 * reads the panel from L3 (a decode step streams every weight once: ~19 MB for two agents of the
 * medium model), the others from L1; the last of them fetches the next panel into L2, so the next
 * first block waits on L2 instead of L3. On an AVX2 EPYC (Zen 3), L-shaped sampling calls with
 * builds alternating in one process, the products' perf samples: -13% (fetching from the second
 * block instead: -11%, as it evicts some of the panel the third still reads; a T2 hint: the same);
 * a step's products alone, streamed in turn, medians 2.47-2.81 -> 2.29-2.52 ms. */
#define ROW_BLOCKS_W16 \
    /* the panel after this one: the next of this weight, or the next agent's first */ \
    const float *next_panel = p + 1 < panels ? panel + k * NR16 \
                              : a + 1 < batch ? packed + (a + 1) * packed_batch_stride : 0; \
    while (r < m) { \
        int64_t left = m - r; \
        int64_t rows = left == 7 || left == 8 ? 4 : left >= 6 ? 6 : left >= 4 ? 4 : left; \
        float *cr = ca + r * ldc + c0; \
        const float *fetch = r > 0 && r + rows == m ? next_panel : 0; \
        switch (rows) { \
            case 6: rows6w16(k, xt + r, m, panel, b, cr, ldc, cols, fetch); break; \
            case 4: rows4w16(k, xt + r, m, panel, b, cr, ldc, cols, fetch); break; \
            case 3: rows3w16(k, xt + r, m, panel, b, cr, ldc, cols, fetch); break; \
            case 2: rows2w16(k, xt + r, m, panel, b, cr, ldc, cols, fetch); break; \
            default: rows1w16(k, xt + r, m, panel, b, cr, ldc, cols, fetch); break; \
        } \
        r += rows; \
    }

/* xt (k x m) = x (m x k, row stride ldx) transposed: 8 x 8 blocks in registers, the edges one
 * float at a time (a decode step transposes every product's input; one float at a time, 16 rows
 * x 256-512 inputs, that was ~1.4% of the step). */
static void transpose_rows(const float *x, int64_t m, int64_t k, int64_t ldx, float *xt) {
    int64_t r = 0;
    for (; r + 8 <= m; r += 8) {
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) {
            __m256 rows[8], columns[8];
            for (int j = 0; j < 8; j++) rows[j] = _mm256_loadu_ps(x + (r + j) * ldx + i);
            transpose8x8(rows, columns);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(xt + (i + j) * m + r, columns[j]);
        }
        for (; i < k; i++)
            for (int j = 0; j < 8; j++) xt[i * m + r + j] = x[(r + j) * ldx + i];
    }
    for (; r < m; r++)
        for (int64_t i = 0; i < k; i++) xt[i * m + r] = x[r * ldx + i];
}

/* One family's driver: for each of `batch` (x, packed weight, bias, c), x transposed into `xt`
 * (k x m), then every panel against the family's row blocks. A kernel reads its rows' inputs for
 * one i from one row of xt, next to each other: one pointer for all rows (x's 16 row pointers did
 * not fit in registers and were reloaded from the stack every i) and one cache line per i at 16
 * rows. */
#define PANEL_DRIVER(NAME, ATTR, WIDTH, BLOCKS) \
static ATTR void NAME(int64_t batch, int64_t m, int64_t n, int64_t k, \
                      const float *x, int64_t x_batch_stride, int64_t ldx, \
                      const float *packed, int64_t packed_batch_stride, \
                      const float *bias, int64_t bias_batch_stride, \
                      float *c, int64_t c_batch_stride, int64_t ldc, float *xt) { \
    int64_t panels = (n + WIDTH - 1) / WIDTH; \
    for (int64_t a = 0; a < batch; a++) { \
        const float *xa = x + a * x_batch_stride, *wa = packed + a * packed_batch_stride; \
        const float *ba = bias ? bias + a * bias_batch_stride : 0; \
        float *ca = c + a * c_batch_stride; \
        transpose_rows(xa, m, k, ldx, xt); \
        for (int64_t p = 0; p < panels; p++) { \
            int64_t c0 = p * WIDTH; \
            int cols = n - c0 < WIDTH ? (int)(n - c0) : WIDTH; \
            const float *panel = wa + p * k * WIDTH, *b = ba ? ba + c0 : 0; \
            int64_t r = 0; \
            BLOCKS \
        } \
    } \
}

PANEL_DRIVER(panel_gemm8, NO_ATTR, NR, ROW_BLOCKS(8, rows8, rows8, rows4, rows3, rows2, rows1))
PANEL_DRIVER(panel_gemm8w16, NO_ATTR, NR16, ROW_BLOCKS_W16)
PANEL_DRIVER(panel_gemm16, AVX512, NR16, ROW_BLOCKS(16, rows16x16, rows8x16, rows4x16, rows3x16, rows2x16, rows1x16))

/* AVX2 with 6-wide panels, the other way round: the rows' inputs, transposed, are the operand that
 * stays in L1 and the weights the one that streams. A kernel keeps 6 outputs x 16 rows (or two
 * panels' 12 outputs x 8 rows) in 12 registers: per input, 2 (1) loads of 16 (8) rows' inputs and
 * 6 (12) broadcast weights. Each weight is read once per step, front to back, whatever the number
 * of rows; the 16-wide kernels above read each panel once per row block (16 rows: 6 + 6 + 4, the
 * first from L3, the 4-row block with only 8 sums in flight). Each sum still runs over k in order,
 * one fused multiply-add at a time, from zero, then adds the bias, so the results equal the other
 * families' bit for bit. Measured on an AVX2 EPYC (Zen 3), one agent's medium-model step
 * projections at 16 rows, weights streamed in turn, the builds alternating in one process: medians
 * 1.17-1.85 -> 1.09-1.56 ms (min 1.09-1.16 -> 1.01-1.14). */
#define PREFETCH_WEIGHTS6 32 /* weight lines (6 floats) ahead: of 0/32/64/128, 32-64 were best */
#define ROWS6 16              /* the rows of the 6-output kernel's block (the 12-output one: NR) */

/* Rows' sums (8 lanes each) of 6 outputs, transposed to 8 rows of 6 floats each, the bias added. */
static inline void store_outputs6(const __m256 sums[NR6], const float *bias, float *c, int64_t ldc, int rows, int cols) {
    __m256 block[8], transposed[8];
    for (int j = 0; j < NR6; j++)
        block[j] = bias && j < cols ? _mm256_add_ps(sums[j], _mm256_set1_ps(bias[j])) : sums[j];
    block[6] = block[7] = _mm256_setzero_ps();
    transpose8x8(block, transposed);
    for (int r = 0; r < rows; r++) {
        float *dst = c + r * ldc;
        if (cols == NR6) {
            _mm_storeu_ps(dst, _mm256_castps256_ps128(transposed[r]));
            _mm_storel_pi((__m64 *)(dst + 4), _mm256_extractf128_ps(transposed[r], 1));
        } else {
            float line[8];
            _mm256_storeu_ps(line, transposed[r]);
            memcpy(dst, line, (size_t)cols * sizeof(float));
        }
    }
}

/* The sums live in named registers (c<j>, d<j>): in arrays handed to the store, the compiler kept
 * them in memory and stored all 12 every input. */
#define OUT6_INIT(j) __m256 c##j = _mm256_setzero_ps(), d##j = _mm256_setzero_ps();
#define OUT6_FMA16(j) { const __m256 wj = _mm256_broadcast_ss(w + (j)); \
    c##j = _mm256_fmadd_ps(xl, wj, c##j); d##j = _mm256_fmadd_ps(xh, wj, d##j); }
#define OUT6_FMA8(j) { c##j = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w + (j)), c##j); \
    d##j = _mm256_fmadd_ps(x, _mm256_broadcast_ss(v + (j)), d##j); }
#define OUT6_FMA8_ONE(j) c##j = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w + (j)), c##j);

/* c (rows x cols of one panel) = xt (k x 16 rows' inputs) times the panel (k x 6) + bias. */
static void outputs6_rows16(int64_t k, const float *panel, const float *xt, const float *bias, float *c, int64_t ldc,
                            int rows, int cols) {
    R6(OUT6_INIT)
    for (int64_t i = 0; i < k; i++) {
        const float *w = panel + i * NR6;
        _mm_prefetch((const char *)(w + PREFETCH_WEIGHTS6 * NR6), _MM_HINT_T0);
        const __m256 xl = _mm256_load_ps(xt + i * ROWS6), xh = _mm256_load_ps(xt + i * ROWS6 + NR);
        R6(OUT6_FMA16)
    }
    const __m256 low[NR6] = {c0, c1, c2, c3, c4, c5}, high[NR6] = {d0, d1, d2, d3, d4, d5};
    store_outputs6(low, bias, c, ldc, rows < NR ? rows : NR, cols);
    if (rows > NR) store_outputs6(high, bias, c + NR * ldc, ldc, rows - NR, cols);
}

/* c (rows x up to 12 outputs) = xt (k x 8 rows' inputs) times two consecutive panels (`pair`), or
 * one (the weight's last, odd panel). */
static void outputs12_rows8(int64_t k, const float *panel, int pair, const float *xt, const float *bias, float *c,
                            int64_t ldc, int rows, int cols) {
    R6(OUT6_INIT)
    if (pair) {
        for (int64_t i = 0; i < k; i++) {
            const float *w = panel + i * NR6, *v = panel + (k + i) * NR6;
            _mm_prefetch((const char *)(w + PREFETCH_WEIGHTS6 * NR6), _MM_HINT_T0);
            _mm_prefetch((const char *)(v + PREFETCH_WEIGHTS6 * NR6), _MM_HINT_T0);
            const __m256 x = _mm256_load_ps(xt + i * NR);
            R6(OUT6_FMA8)
        }
    } else {
        for (int64_t i = 0; i < k; i++) {
            const float *w = panel + i * NR6;
            const __m256 x = _mm256_load_ps(xt + i * NR);
            R6(OUT6_FMA8_ONE)
        }
    }
    const __m256 first[NR6] = {c0, c1, c2, c3, c4, c5}, second[NR6] = {d0, d1, d2, d3, d4, d5};
    store_outputs6(first, bias, c, ldc, rows, cols < NR6 ? cols : NR6);
    if (pair) store_outputs6(second, bias ? bias + NR6 : 0, c + NR6, ldc, rows, cols - NR6);
}

/* xt (k x `block` rows, block 8 or 16) = rows r < m of x (row stride ldx) transposed, zeros for the
 * block's rows past m. */
static void transpose_block(const float *x, int64_t m, int64_t k, int64_t ldx, int block, float *xt) {
    for (int r0 = 0; r0 < block; r0 += 8) {
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) {
            __m256 rows[8], columns[8];
            for (int j = 0; j < 8; j++)
                rows[j] = r0 + j < m ? _mm256_loadu_ps(x + (r0 + j) * ldx + i) : _mm256_setzero_ps();
            transpose8x8(rows, columns);
            for (int j = 0; j < 8; j++) _mm256_store_ps(xt + (i + j) * block + r0, columns[j]);
        }
        for (; i < k; i++)
            for (int j = 0; j < 8; j++) xt[i * block + r0 + j] = r0 + j < m ? x[(r0 + j) * ldx + i] : 0.0f;
    }
}

/* The 6-wide family's rows per block: 16, or 8 for the last 8 or fewer (a smaller block pads to 8). */
static int64_t block_rows6(int64_t left) { return left > NR ? ROWS6 : NR; }

/* The floats of the transposed copies of m rows' k inputs: every block padded to its 8 or 16 rows. */
static int64_t transposed_floats6(int64_t m, int64_t k) {
    int64_t floats = 0;
    for (int64_t r = 0; r < m; r += ROWS6) floats += block_rows6(m - r) * k;
    return floats;
}

/* The 6-wide family's driver: for each of `batch` (x, packed weight, bias, c), every block of rows
 * transposed into xt, then each panel against every block (the panel, 6 x k floats, stays in L1
 * while the blocks, from L2, take their turns). */
static void panel_gemm6(int64_t batch, int64_t m, int64_t n, int64_t k,
                        const float *x, int64_t x_batch_stride, int64_t ldx,
                        const float *packed, int64_t packed_batch_stride,
                        const float *bias, int64_t bias_batch_stride,
                        float *c, int64_t c_batch_stride, int64_t ldc, float *xt) {
    const int64_t panels = (n + NR6 - 1) / NR6;
    for (int64_t a = 0; a < batch; a++) {
        const float *xa = x + a * x_batch_stride, *wa = packed + a * packed_batch_stride;
        const float *ba = bias ? bias + a * bias_batch_stride : 0;
        float *ca = c + a * c_batch_stride;
        float *block = xt;
        for (int64_t r = 0; r < m; r += ROWS6) {
            const int rows = (int)block_rows6(m - r);
            transpose_block(xa + r * ldx, m - r < rows ? m - r : rows, k, ldx, rows, block);
            block += rows * k;
        }
        for (int64_t p = 0; p < panels; p++) {
            const int64_t c0 = p * NR6;
            const float *panel = wa + p * k * NR6, *b = ba ? ba + c0 : 0;
            const int pair = p + 1 < panels;
            block = xt;
            for (int64_t r = 0; r < m; r += ROWS6) {
                const int rows = (int)block_rows6(m - r), live = m - r < rows ? (int)(m - r) : rows;
                if (rows == ROWS6) {
                    outputs6_rows16(k, panel, block, b, ca + r * ldc + c0, ldc, live, n - c0 < NR6 ? (int)(n - c0) : NR6);
                } else if (p % 2 == 0) {  /* 8-row blocks take the panels two at a time */
                    const int64_t cols = n - c0 < 2 * NR6 ? n - c0 : 2 * NR6;
                    outputs12_rows8(k, panel, pair, block, b, ca + r * ldc + c0, ldc, live, (int)cols);
                }
                block += rows * k;
            }
        }
    }
}

/* c (m x n, row stride ldc) = x (m x k, row stride ldx) times the weight packed `width` wide, plus
 * bias (padded to whole panels; NULL for none), for each of `batch` (x, packed weight, bias, c).
 * Width NR6 runs the 6-wide AVX2 kernels, NR the 8-wide ones; width NR16 the AVX-512 ones when
 * `avx512` is set (the caller has checked the CPU runs them), else the 16-wide AVX2 ones. Returns 0, or -1 (c
 * untouched) when the transposed copy of x cannot be allocated. */
static void panel_product(int64_t batch, int64_t m, int64_t n, int64_t k,
                          const float *x, int64_t x_batch_stride, int64_t ldx,
                          const float *packed, int64_t packed_batch_stride,
                          const float *bias, int64_t bias_batch_stride,
                          float *c, int64_t c_batch_stride, int64_t ldc, int64_t width, int64_t avx512, float *xt) {
    (width == NR6 ? panel_gemm6 : width == NR ? panel_gemm8 : avx512 ? panel_gemm16 : panel_gemm8w16)(
        batch, m, n, k, x, x_batch_stride, ldx, packed, packed_batch_stride, bias, bias_batch_stride, c,
        c_batch_stride, ldc, xt);
}

int comlrl_panel_gemm(int64_t batch, int64_t m, int64_t n, int64_t k,
                       const float *x, int64_t x_batch_stride, int64_t ldx,
                       const float *packed, int64_t packed_batch_stride,
                       const float *bias, int64_t bias_batch_stride,
                       float *c, int64_t c_batch_stride, int64_t ldc, int64_t width, int64_t avx512) {
    const int64_t floats = width == NR6 ? transposed_floats6(m, k) : m * k;
    size_t bytes = ((size_t)floats * sizeof(float) + 63) / 64 * 64;  /* aligned_alloc wants a multiple */
    float *xt = aligned_alloc(64, bytes ? bytes : 64);
    if (!xt) return -1;
    panel_product(batch, m, n, k, x, x_batch_stride, ldx, packed, packed_batch_stride, bias, bias_batch_stride, c,
                  c_batch_stride, ldc, width, avx512, xt);
    free(xt);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Decode attention: one new query token per row against its prompt's shared keys and values and
 * its own generated ones (the cache layout of lean.StackedLeanDecoder.step), one softmax over both.
 * ------------------------------------------------------------------------------------------------ */

/* e^x for 8 floats (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n), to ~1 ulp.
 * Inputs below -87.3 (the -inf of masked scores among them) give exactly 0, as expf would underflow. */
static inline __m256 exp8(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.3f);
    __m256 zero_mask = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, low), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Lanes 0 .. left - 1 of 8 (1 <= left <= 8). */
static inline __m256i first_lanes(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Scores of NQ queries (up to 4, query i with its own bias row bias[i]) against BLOCKS (up to 4)
 * blocks of 8 key columns from column j, the last holding `left` columns (masked loads and stores
 * past them). A column's sum runs over d in order whatever the blocking: acc = fma(q[d], key[d],
 * acc) from 0, then fma(acc, scale, bias). Each key load serves all NQ queries. */
static inline __attribute__((always_inline)) void score_tile(int nq, int blocks, int64_t left, const float *const *q,
                                                             const float *keys, int64_t key_stride, int64_t dim,
                                                             const float *const *bias, __m256 scale,
                                                             float *const *scores, int64_t j) {
    const __m256i mask = first_lanes(left);
    __m256 acc[4][4], column[4];
    for (int i = 0; i < nq; i++)
        for (int b = 0; b < blocks; b++) acc[i][b] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        const float *k = keys + d * key_stride + j;
        for (int b = 0; b < blocks; b++)
            column[b] = b == blocks - 1 && left < 8 ? _mm256_maskload_ps(k + 8 * b, mask) : _mm256_loadu_ps(k + 8 * b);
        for (int i = 0; i < nq; i++) {
            const __m256 qd = _mm256_set1_ps(q[i][d]);
            for (int b = 0; b < blocks; b++) acc[i][b] = _mm256_fmadd_ps(qd, column[b], acc[i][b]);
        }
    }
    for (int b = 0; b < blocks; b++) {
        const int tail = b == blocks - 1 && left < 8;
        for (int i = 0; i < nq; i++) {
            const float *add = bias[i] + j + 8 * b;
            const __m256 score = _mm256_fmadd_ps(acc[i][b], scale, tail ? _mm256_maskload_ps(add, mask) : _mm256_loadu_ps(add));
            if (tail) _mm256_maskstore_ps(scores[i] + j + 8 * b, mask, score);
            else _mm256_storeu_ps(scores[i] + j + 8 * b, score);
        }
    }
}

/* score_tile over all `count` columns (key row stride key_stride) for NQ queries, WIDEST (3 or 4)
 * blocks at a time, then the last 1 .. WIDEST blocks: NQ x WIDEST sums in flight, 12 at most (a
 * block's sum is a chain of dependent multiply-adds that waits on the FMA latency at every input:
 * one query, one block at a time, as first written, a 2-agent x 16-row step's attention took
 * 113 us, 69 with 4 blocks, ~40 with heads paired and masked tails, bit for bit). */
static inline __attribute__((always_inline)) void tile_scores(int nq, int widest, const float *const *q,
                                                              const float *keys, int64_t key_stride, int64_t count,
                                                              int64_t dim, const float *const *bias, __m256 scale,
                                                              float *const *scores) {
    int64_t j = 0;
    for (; j + 8 * widest <= count; j += 8 * widest)
        score_tile(nq, widest, 8, q, keys, key_stride, dim, bias, scale, scores, j);
    const int64_t rest = count - j;
    switch ((rest + 7) / 8) {
        case 4: score_tile(nq, 4, rest - 24, q, keys, key_stride, dim, bias, scale, scores, j); break;
        case 3: score_tile(nq, 3, rest - 16, q, keys, key_stride, dim, bias, scale, scores, j); break;
        case 2: score_tile(nq, 2, rest - 8, q, keys, key_stride, dim, bias, scale, scores, j); break;
        case 1: score_tile(nq, 1, rest, q, keys, key_stride, dim, bias, scale, scores, j); break;
        default: break;
    }
}

/* scores[h][j] (j < count) = bias[j] + scale * sum_d q[h][d] * keys[d * key_stride + j] for NH
 * (1 or 2) query heads of one KV head: keys stored transposed (head_dim rows of `count` columns,
 * row stride key_stride), each read once for both heads, 4 blocks of 8 columns at a time. */
static inline __attribute__((always_inline)) void head_scores(int nh, const float *const *q, const float *keys,
                                                              int64_t key_stride, int64_t count, int64_t dim,
                                                              const float *bias, float scale, float *const *scores) {
    const float *biases[2] = {bias, bias};
    tile_scores(nh, 4, q, keys, key_stride, count, dim, biases, _mm256_set1_ps(scale), scores);
}

/* Lane reductions and softmax passes over a row of n floats, 8 lanes at a time with a masked tail
 * (the decode attention's softmax and the training attention's, `comlrl_attention_softmax`). */

/* The running maximum vmax updated with x[0 .. n-1]. */
static inline __m256 row_max(const float *x, int64_t n, __m256 vmax) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + j));
    if (j < n) {
        const __m256i mask = first_lanes(n - j);
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(x + j, mask),
                                                     _mm256_castsi256_ps(mask)));
    }
    return vmax;
}

/* x[0 .. n-1] = e^(x - shift), their sum added to vsum (masked tail). */
static inline __m256 exp_shifted_sum(float *x, int64_t n, __m256 shift, __m256 vsum) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift));
        _mm256_storeu_ps(x + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (j < n) {
        const __m256i mask = first_lanes(n - j);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(x + j, mask), shift)),
                                       _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(x + j, mask, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    return vsum;
}

static inline void scale_in_place(float *x, int64_t n, float factor) {
    const __m256 f = _mm256_set1_ps(factor);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), f));
    for (; j < n; j++) x[j] *= factor;
}

static inline float lanes_max(__m256 v) {
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    return top;
}

static inline float lanes_sum(__m256 v) {
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; i++) total += lanes[i];
    return total;
}

static inline int32_t lanes_sum_epi32(__m256i v) {
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
    return _mm_cvtsi128_si32(sum);
}

/* scores <- softmax(scores) over `count` values, in place. */
static void softmax(float *scores, int64_t count) {
    const __m256 shift = _mm256_set1_ps(lanes_max(row_max(scores, count, _mm256_set1_ps(-INFINITY))));
    scale_in_place(scores, count, 1.0f / lanes_sum(exp_shifted_sum(scores, count, shift, _mm256_setzero_ps())));
}

/* out[h][d] += sum_j probs[h][j] * values[j * dim + d] for NH (1 or 2) heads of one KV head
 * (values: count rows of dim, each read once for both heads), each out[h][d] summed over j in
 * order. 32 outputs per head stay in registers across j (storing and reloading them at every j
 * chained each multiply-add behind the last one's store). */
static inline __attribute__((always_inline)) void head_values(int nh, const float *const *probs, const float *values,
                                                              int64_t count, int64_t dim, float *const *out) {
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32) {
        __m256 o[2][4];
        for (int h = 0; h < nh; h++)
            for (int b = 0; b < 4; b++) o[h][b] = _mm256_loadu_ps(out[h] + d + 8 * b);
        for (int64_t j = 0; j < count; j++) {
            const float *row = values + j * dim + d;
            __m256 v[4];
            for (int b = 0; b < 4; b++) v[b] = _mm256_loadu_ps(row + 8 * b);
            for (int h = 0; h < nh; h++) {
                const __m256 p = _mm256_set1_ps(probs[h][j]);
                for (int b = 0; b < 4; b++) o[h][b] = _mm256_fmadd_ps(p, v[b], o[h][b]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int b = 0; b < 4; b++) _mm256_storeu_ps(out[h] + d + 8 * b, o[h][b]);
    }
    for (; d + 8 <= dim; d += 8)
        for (int h = 0; h < nh; h++) {
            __m256 o = _mm256_loadu_ps(out[h] + d);
            for (int64_t j = 0; j < count; j++)
                o = _mm256_fmadd_ps(_mm256_set1_ps(probs[h][j]), _mm256_loadu_ps(values + j * dim + d), o);
            _mm256_storeu_ps(out[h] + d, o);
        }
    for (; d < dim; d++)
        for (int h = 0; h < nh; h++)
            for (int64_t j = 0; j < count; j++) out[h][d] = fmaf(probs[h][j], values[j * dim + d], out[h][d]);
}

/* out[i][d0 ..] = sum_j probs[i][j] * values[j * dim + d0 ..] (j < count, in order, from 0) for NQ
 * (up to 4) queries and BLOCKS (up to 3) blocks of 8 outputs: the prefix values' part of several
 * rows at once, each value row loaded once for all of them. */
static inline __attribute__((always_inline)) void shared_value_tile(int nq, int blocks, const float *const *probs,
                                                                    const float *values, int64_t count, int64_t dim,
                                                                    float *const *out, int64_t d0) {
    __m256 acc[4][3];
    for (int i = 0; i < nq; i++)
        for (int b = 0; b < blocks; b++) acc[i][b] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; j++) {
        const float *row = values + j * dim + d0;
        __m256 v[3];
        for (int b = 0; b < blocks; b++) v[b] = _mm256_loadu_ps(row + 8 * b);
        for (int i = 0; i < nq; i++) {
            const __m256 p = _mm256_set1_ps(probs[i][j]);
            for (int b = 0; b < blocks; b++) acc[i][b] = _mm256_fmadd_ps(p, v[b], acc[i][b]);
        }
    }
    for (int i = 0; i < nq; i++)
        for (int b = 0; b < blocks; b++) _mm256_storeu_ps(out[i] + d0 + 8 * b, acc[i][b]);
}

static inline __attribute__((always_inline)) void shared_values(int nq, const float *const *probs, const float *values,
                                                                int64_t count, int64_t dim, float *const *out) {
    int64_t d = 0;
    for (; d + 24 <= dim; d += 24) shared_value_tile(nq, 3, probs, values, count, dim, out, d);
    switch ((dim - d) / 8) {
        case 2: shared_value_tile(nq, 2, probs, values, count, dim, out, d); d += 16; break;
        case 1: shared_value_tile(nq, 1, probs, values, count, dim, out, d); d += 8; break;
        default: break;
    }
    for (; d < dim; d++)
        for (int i = 0; i < nq; i++) {
            float o = 0.0f;
            for (int64_t j = 0; j < count; j++) o = fmaf(probs[i][j], values[j * dim + d], o);
            out[i][d] = o;
        }
}

/* Up to 4 queries' prefix scores or prefix values at a time, by count (a switch, so each tile
 * size is compiled with constant bounds and its sums stay in registers): `count` key columns of a
 * prefix whose key rows are `key_stride` apart, value rows `dim` apart. */
static void shared_prefix_scores(int64_t n, const float *const *q, const float *keys, int64_t key_stride,
                                 int64_t count, int64_t dim, const float *const *bias, float scale,
                                 float *const *scores) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 4)  /* 4 queries x 3 blocks: 12 sums in flight */
        switch (n - i >= 4 ? 4 : n - i) {
            case 4: tile_scores(4, 3, q + i, keys, key_stride, count, dim, bias + i, vscale, scores + i); break;
            case 3: tile_scores(3, 3, q + i, keys, key_stride, count, dim, bias + i, vscale, scores + i); break;
            case 2: tile_scores(2, 3, q + i, keys, key_stride, count, dim, bias + i, vscale, scores + i); break;
            default: tile_scores(1, 3, q + i, keys, key_stride, count, dim, bias + i, vscale, scores + i); break;
        }
}

static void shared_prefix_values(int64_t n, const float *const *probs, const float *values, int64_t count, int64_t dim,
                          float *const *out) {
    for (int64_t i = 0; i < n; i += 4)
        switch (n - i >= 4 ? 4 : n - i) {
            case 4: shared_values(4, probs + i, values, count, dim, out + i); break;
            case 3: shared_values(3, probs + i, values, count, dim, out + i); break;
            case 2: shared_values(2, probs + i, values, count, dim, out + i); break;
            default: shared_values(1, probs + i, values, count, dim, out + i); break;
        }
}

/* How many of a prompt's first prefix columns every pass over `rows` of its rows may skip: the
 * left padding all of them mask (-inf in their bias rows; a prompt's rows share it), rounded down
 * to whole 8-column lane groups. Those columns' probabilities are exactly 0, so their terms add
 * nothing to the softmax's sum or to the values' sums; and starting a row's softmax a whole lane
 * group later keeps every column in its lane, so each lane sums the same terms in the same order:
 * the results are the same bit for bit, from less work (a batch's shorter prompts are padded to
 * its longest; the L benchmark's sampling calls skip 224 of their 1,894 prompt columns). */
static int64_t padding_to_skip(const float *bias, int64_t bias_stride, int64_t rows, int64_t width) {
    int64_t skip = width;
    for (int64_t r = 0; r < rows && skip >= 8; r++) {
        const float *row = bias + r * bias_stride;
        int64_t masked = 0;
        while (masked < skip && row[masked] == -INFINITY) masked++;
        skip = masked;
    }
    return skip / 8 * 8;
}

/* The most queries comlrl_decode_attention takes together (its pointer arrays): a prompt with
 * more rows x query heads per KV head goes in parts of this many. */
#define ATTENTION_QUERIES 256

/* For each row r (prompt r / group_size) and query head h (KV head h / group):
 *   out[r, h] = softmax(bias[r] + scale * q[r, h] . [prefix keys, own keys]) . [prefix values, own values]
 * q: row r, head h at q + r * q_row_stride + h * dim. prefix_keys (prompts, kv, dim, width),
 * prefix_values (prompts, kv, width, dim), keys (rows, kv, dim, max_new), values (rows, kv, max_new, dim),
 * all contiguous; the first `steps` generated columns are used. bias: row r at bias + r * bias_stride,
 * width + steps values. out: (rows, heads * dim), contiguous. scratch:
 * comlrl_decode_attention_scratch_floats(group_size, group, width, steps) floats.
 *
 * A prompt's rows share its prefix, so per prompt and KV head the prefix scores and the prefix
 * values run for all its queries together (up to 4 at a time: each key and value row loaded once
 * for 4 queries, 12 sums in flight), the own columns row by row with the row's query heads paired;
 * then each query's softmax over both, and its values: the prefix's from 0, then its own, each sum
 * over the columns in order as before (the same results bit for bit). A 2-agent x 16-row step's
 * attention at the L benchmark's shape, warm, alternating: ~72-73 -> ~64-68 us per layer (AVX2 EPYC). */
int64_t comlrl_decode_attention_scratch_floats(int64_t group_size, int64_t group, int64_t width, int64_t steps) {
    const int64_t part_rows = ATTENTION_QUERIES / group > 0 ? ATTENTION_QUERIES / group : 1;
    return (group_size < part_rows ? group_size : part_rows) * group * (width + steps);
}

void comlrl_decode_attention(int64_t rows, int64_t kv_heads, int64_t group, int64_t dim, int64_t group_size,
                             const float *q, int64_t q_row_stride,
                             const float *prefix_keys, const float *prefix_values, int64_t width,
                             const float *keys, const float *values, int64_t max_new, int64_t steps,
                             const float *bias, int64_t bias_stride, float scale, float *out, float *scratch) {
    const int64_t heads = kv_heads * group, count = width + steps;
    const int64_t part_rows = ATTENTION_QUERIES / group > 0 ? ATTENTION_QUERIES / group : 1;
    const float *qs[part_rows * group], *biases[part_rows * group], *kept_biases[part_rows * group];
    float *scores[part_rows * group], *outs[part_rows * group], *kept_scores[part_rows * group];
    for (int64_t r0 = 0, prompt_rows; r0 < rows; r0 += prompt_rows) {  /* a prompt's rows, or part of them */
        const int64_t prompt = r0 / group_size, prompt_end = (prompt + 1) * group_size;
        const int64_t end = prompt_end < rows ? prompt_end : rows;
        prompt_rows = end - r0 < part_rows ? end - r0 : part_rows;
        const int64_t n = prompt_rows * group;
        const int64_t skip = padding_to_skip(bias + r0 * bias_stride, bias_stride, prompt_rows, width);
        for (int64_t kv = 0; kv < kv_heads; kv++) {
            for (int64_t i = 0; i < n; i++) {  /* query i: row r0 + i / group, head kv * group + i % group */
                const int64_t r = r0 + i / group, h = kv * group + i % group;
                qs[i] = q + r * q_row_stride + h * dim;
                biases[i] = bias + r * bias_stride;
                scores[i] = scratch + i * count;
                outs[i] = out + (r * heads + h) * dim;
                kept_biases[i] = biases[i] + skip;
                kept_scores[i] = scores[i] + skip;
            }
            shared_prefix_scores(n, qs, prefix_keys + (prompt * kv_heads + kv) * dim * width + skip, width, width - skip,
                                 dim, kept_biases, scale, kept_scores);
            for (int64_t r = r0; r < r0 + prompt_rows; r++) {  /* own columns: the row's query heads in pairs */
                const float *ok = keys + (r * kv_heads + kv) * dim * max_new;
                const int64_t first = (r - r0) * group;
                int64_t i = first;
                for (; i + 2 <= first + group; i += 2) {
                    float *own[2] = {scores[i] + width, scores[i + 1] + width};
                    head_scores(2, qs + i, ok, max_new, steps, dim, biases[i] + width, scale, own);
                }
                if (i < first + group) {
                    float *own[1] = {scores[i] + width};
                    head_scores(1, qs + i, ok, max_new, steps, dim, biases[i] + width, scale, own);
                }
            }
            for (int64_t i = 0; i < n; i++) softmax(kept_scores[i], count - skip);
            shared_prefix_values(n, (const float *const *)kept_scores,
                                 prefix_values + ((prompt * kv_heads + kv) * width + skip) * dim, width - skip, dim, outs);
            for (int64_t r = r0; r < r0 + prompt_rows; r++) {
                const float *ov = values + (r * kv_heads + kv) * max_new * dim;
                const int64_t first = (r - r0) * group;
                int64_t i = first;
                for (; i + 2 <= first + group; i += 2) {
                    const float *own[2] = {scores[i] + width, scores[i + 1] + width};
                    head_values(2, own, ov, steps, dim, outs + i);
                }
                if (i < first + group) {
                    const float *own[1] = {scores[i] + width};
                    head_values(1, own, ov, steps, dim, outs + i);
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * A decode step's elementwise work between the products: in a step, each of these replaced 2-4
 * torch calls that cost 5-30 us apiece on (agents, 8-32 rows, hidden) tensors, mostly per-call
 * overhead with caches cold from streaming the weights.
 */

/* hidden (rows x dim, contiguous) += delta (same shape; NULL: nothing added), then
 * out = hidden / sqrt(mean(hidden^2) + eps) row by row: a residual add and the scale-free RMSNorm
 * that follows it (the decoders fold the norm's scale into the next projection). */
void comlrl_residual_rms_norm(int64_t rows, int64_t dim, float *hidden, const float *delta, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * dim;
        __m256 squares = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8) {
            __m256 v = _mm256_loadu_ps(h + d);
            if (delta) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(delta + r * dim + d));
                _mm256_storeu_ps(h + d, v);
            }
            squares = _mm256_fmadd_ps(v, v, squares);
        }
        float sum = lanes_sum(squares);
        for (; d < dim; d++) {
            if (delta) h[d] += delta[r * dim + d];
            sum = fmaf(h[d], h[d], sum);
        }
        const float inverse = 1.0f / sqrtf(sum / (float)dim + eps);
        const __m256 scale = _mm256_set1_ps(inverse);
        float *o = out + r * dim;
        for (d = 0; d + 8 <= dim; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(h + d), scale));
        for (; d < dim; d++) o[d] = h[d] * inverse;
    }
}

/* sigmoid(g) = 1 / (1 + e^-g), 8 at a time; SwiGLU's forward and backward share it, so the
 * backward recomputes the forward's output bitwise. */
static inline __m256 sigmoid8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

/* out (rows x n) = silu(gate) * up for gate_up (rows x 2n) = [gate | up] per row: SwiGLU,
 * silu(g) = g sigmoid(g). */
void comlrl_silu_mul(int64_t rows, int64_t n, const float *gate_up, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), _mm256_loadu_ps(up + i)));
        }
        for (; i < n; i++) o[i] = gate[i] * (1.0f / (1.0f + expf(-gate[i]))) * up[i];
    }
}

/* One head's rotary pairs (rotary pairs adjacent): pair p = (in[2p], in[2p + 1]) times rot[p] =
 * (cos, sign * sin) as a complex product, into out (may be in). */
static inline void rotate_head(const float *in, const float *rot, float sign, int64_t half, float *out) {
    for (int64_t p = 0; p < half; p++) {
        const float a = in[2 * p], b = in[2 * p + 1], c = rot[2 * p], s = sign * rot[2 * p + 1];
        out[2 * p] = a * c - b * s;
        out[2 * p + 1] = a * s + b * c;
    }
}

/* One decode step's rotary embedding and cache write, per row r of qkv (rows x [q heads | k heads
 * | v heads] x dim, row stride ld): every query and key head rotated in place, pair p = (x[2p],
 * x[2p + 1]) times rotation[r][p] = (cos, sin) as a complex product (rotary pairs adjacent); then
 * the rotated keys written transposed at column `column` of the row's cache keys (rows, kv, dim,
 * max_new) and the values at that column of its values (rows, kv, max_new, dim). */
void comlrl_rotate_into_cache(int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, float *qkv, int64_t ld,
                              const float *rotation, float *keys, float *values, int64_t max_new, int64_t column) {
    const int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * ld;
        const float *rot = rotation + r * dim;  /* half (cos, sin) pairs */
        for (int64_t h = 0; h < heads + kv_heads; h++) rotate_head(row + h * dim, rot, 1.0f, half, row + h * dim);
        for (int64_t kv = 0; kv < kv_heads; kv++) {
            const float *k = row + (heads + kv) * dim, *v = row + (heads + kv_heads + kv) * dim;
            float *key_column = keys + (r * kv_heads + kv) * dim * max_new + column;
            float *value_row = values + ((r * kv_heads + kv) * max_new + column) * dim;
            for (int64_t d = 0; d < dim; d++) key_column[d * max_new] = k[d];
            memcpy(value_row, v, dim * sizeof(float));
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * The training pass's elementwise work on fp32 activations (`training_ops`): each kernel is one
 * pass over the rows where the torch ops made 3-6 (and SwiGLU's took strided halves of gate_up).
 */

/* SwiGLU's backward for gate_up (rows x 2n) = [gate | up] per row and the gradient of
 * silu(gate) * up, grad_hidden (rows x n): grad_gate_up (rows x 2n) = [grad_hidden * up *
 * s (1 + gate (1 - s)) | grad_hidden * gate s], s = sigmoid(gate); with `hidden` (not NULL), also
 * the forward's output silu(gate) * up (rows x n), as comlrl_silu_mul computes it, from the same
 * pass over gate_up (the weight gradient of the projection after SwiGLU needs it). With
 * `gate_up_rows` (not NULL), row r of gate_up is at the address gate_up_rows[r] instead (rows read
 * in place where they were recorded, `ProjectionRecord`), and `gate_up` is not read. */
void comlrl_swiglu_backward(int64_t rows, int64_t n, const float *gate_up, const int64_t *gate_up_rows,
                            const float *grad_hidden, float *grad_gate_up, float *hidden) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up_rows ? (const float *)(intptr_t)gate_up_rows[r] : gate_up + r * 2 * n;
        const float *up = gate + n, *grad = grad_hidden + r * n;
        float *grad_gate = grad_gate_up + r * 2 * n, *grad_up = grad_gate + n, *h = hidden ? hidden + r * n : 0;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i), gh = _mm256_loadu_ps(grad + i), u = _mm256_loadu_ps(up + i);
            const __m256 s = sigmoid8(g), silu = _mm256_mul_ps(g, s);
            if (h) _mm256_storeu_ps(h + i, _mm256_mul_ps(silu, u));
            _mm256_storeu_ps(grad_up + i, _mm256_mul_ps(gh, silu));
            const __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(g, _mm256_sub_ps(one, s), one));
            _mm256_storeu_ps(grad_gate + i, _mm256_mul_ps(_mm256_mul_ps(gh, u), slope));
        }
        for (; i < n; i++) {
            const float s = 1.0f / (1.0f + expf(-gate[i]));
            if (h) h[i] = gate[i] * s * up[i];
            grad_up[i] = grad[i] * (gate[i] * s);
            grad_gate[i] = grad[i] * up[i] * (s * (1.0f + gate[i] * (1.0f - s)));
        }
    }
}

/* One row's sum of squares, 8 lanes then across them. */
static inline float sum_of_squares(const float *x, int64_t dim) {
    __m256 squares = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        const __m256 v = _mm256_loadu_ps(x + d);
        squares = _mm256_fmadd_ps(v, v, squares);
    }
    float sum = lanes_sum(squares);
    for (; d < dim; d++) sum = fmaf(x[d], x[d], sum);
    return sum;
}

/* RMSNorm with its scale: rstd[r] = 1 / sqrt(mean(x[r]^2) + eps) and out[r] = weight * (x[r] *
 * rstd[r]) (rows x dim, contiguous); with rstd_in (not NULL) the given rstd is used instead, so a
 * backward pass recomputes exactly the forward's output. */
void comlrl_rms_norm(int64_t rows, int64_t dim, const float *x, const float *weight, float eps,
                     const float *rstd_in, float *rstd_out, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * dim;
        const float rstd = rstd_in ? rstd_in[r] : 1.0f / sqrtf(sum_of_squares(row, dim) / (float)dim + eps);
        if (rstd_out) rstd_out[r] = rstd;
        if (!out) continue;  /* the scale only (a replayed projection needs no normalized input) */
        const __m256 scale = _mm256_set1_ps(rstd);
        float *o = out + r * dim;
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(weight + d), _mm256_mul_ps(_mm256_loadu_ps(row + d), scale)));
        for (; d < dim; d++) o[d] = weight[d] * (row[d] * rstd);
    }
}

/* RMSNorm's backward, out = weight * x_hat, x_hat = x * rstd: grad_x[r] = rstd[r] * (g - x_hat
 * mean(g x_hat)) with g = grad[r] * weight; grad_weight (dim; NULL: not wanted) = sum over rows of
 * grad * x_hat, accumulated row by row into zeroed memory. */
void comlrl_rms_norm_backward(int64_t rows, int64_t dim, const float *grad, const float *x, const float *rstd,
                              const float *weight, float *grad_x, float *grad_weight) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = grad + r * dim, *row = x + r * dim;
        const __m256 scale = _mm256_set1_ps(rstd[r]);
        __m256 dots = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8) {
            const __m256 x_hat = _mm256_mul_ps(_mm256_loadu_ps(row + d), scale), gd = _mm256_loadu_ps(g + d);
            dots = _mm256_fmadd_ps(_mm256_mul_ps(gd, _mm256_loadu_ps(weight + d)), x_hat, dots);
            if (grad_weight) _mm256_storeu_ps(grad_weight + d, _mm256_fmadd_ps(gd, x_hat, _mm256_loadu_ps(grad_weight + d)));
        }
        float dot = lanes_sum(dots);
        for (; d < dim; d++) {
            const float x_hat = row[d] * rstd[r];
            dot = fmaf(g[d] * weight[d], x_hat, dot);
            if (grad_weight) grad_weight[d] = fmaf(g[d], x_hat, grad_weight[d]);
        }
        const __m256 mean = _mm256_set1_ps(dot / (float)dim);
        float *gx = grad_x + r * dim;
        for (d = 0; d + 8 <= dim; d += 8) {
            const __m256 x_hat = _mm256_mul_ps(_mm256_loadu_ps(row + d), scale);
            const __m256 gw = _mm256_mul_ps(_mm256_loadu_ps(g + d), _mm256_loadu_ps(weight + d));
            _mm256_storeu_ps(gx + d, _mm256_mul_ps(_mm256_fnmadd_ps(x_hat, mean, gw), scale));
        }
        for (; d < dim; d++) gx[d] = (g[d] * weight[d] - row[d] * rstd[r] * (dot / (float)dim)) * rstd[r];
    }
}

/* ------------------------------------------------------------------------------------------------
 * Sampling one token per row (`rollout.draw_tokens` with top-k): temperature -> top-k -> top-p ->
 * inverse-CDF draw with the row's uniform. Ties among the top k keep the lower token id first.
 */
/* Whether candidate a ranks below candidate b: a lower logit, or the same logit and a higher token id. */
static inline int ranks_below(float value_a, int64_t id_a, float value_b, int64_t id_b) {
    return value_a < value_b || (value_a == value_b && id_a > id_b);
}

static inline void swap_candidates(float *values, int64_t *ids, int64_t i, int64_t j) {
    float v = values[i]; values[i] = values[j]; values[j] = v;
    int64_t t = ids[i]; ids[i] = ids[j]; ids[j] = t;
}

/* Restores the heap below position i (the lowest-ranked candidate at the root) over n candidates. */
static void sift_down(float *values, int64_t *ids, int64_t n, int64_t i) {
    for (;;) {
        int64_t low = i, child = 2 * i + 1;
        if (child < n && ranks_below(values[child], ids[child], values[low], ids[low])) low = child;
        if (child + 1 < n && ranks_below(values[child + 1], ids[child + 1], values[low], ids[low])) low = child + 1;
        if (low == i) return;
        swap_candidates(values, ids, i, low);
        i = low;
    }
}

/* Sorts n (<= RANK_SORT_MAX) candidates best first, ranked as above (ids below 2^31), by counting
 * for each the candidates ranked above it, 8 at a time, and putting it at that position; returns 0
 * with nothing moved where a value is NaN (no order to count). The heap sort this replaced took
 * about half of a draw at k = 50 (~5 us a row, most of it mispredicted branches); this is
 * branch-free, O(k^2 / 8), and gives the same order: the ranking is total over distinct ids. */
#define RANK_SORT_MAX 256
static int rank_sort(float *values, int64_t *ids, int64_t n) {
    float v[RANK_SORT_MAX] __attribute__((aligned(32))), sorted_values[RANK_SORT_MAX];
    int32_t id[RANK_SORT_MAX] __attribute__((aligned(32)));
    int64_t sorted_ids[RANK_SORT_MAX];
    const int64_t padded = (n + 7) / 8 * 8;
    for (int64_t i = 0; i < n; i++) {
        if (values[i] != values[i]) return 0;
        v[i] = values[i];
        id[i] = (int32_t)ids[i];
    }
    for (int64_t i = n; i < padded; i++) {  /* ranked below everything, -inf included (higher id) */
        v[i] = -INFINITY;
        id[i] = INT32_MAX;
    }
    for (int64_t i = 0; i < n; i++) {
        const __m256 vi = _mm256_set1_ps(v[i]);
        const __m256i idi = _mm256_set1_epi32(id[i]);
        __m256i above = _mm256_setzero_si256();
        for (int64_t j = 0; j < padded; j += 8) {
            const __m256 vj = _mm256_load_ps(v + j);
            const __m256 tie_lower_id = _mm256_and_ps(_mm256_cmp_ps(vj, vi, _CMP_EQ_OQ),
                                                      _mm256_castsi256_ps(_mm256_cmpgt_epi32(idi, _mm256_load_si256((const __m256i *)(id + j)))));
            above = _mm256_sub_epi32(above, _mm256_castps_si256(_mm256_or_ps(_mm256_cmp_ps(vj, vi, _CMP_GT_OQ), tie_lower_id)));
        }
        const int rank = lanes_sum_epi32(above);
        sorted_values[rank] = values[i];
        sorted_ids[rank] = ids[i];
    }
    memcpy(values, sorted_values, (size_t)n * sizeof(float));
    memcpy(ids, sorted_ids, (size_t)n * sizeof(int64_t));
    return 1;
}

/* The top_k (<= RANK_SORT_MAX) best of a row of vocab (<= THRESHOLD_VOCAB) logits into values and
 * ids, in id order, by finding the k-th best value first: each logit as an int32 that orders as
 * the floats do, then a bisection over those keys, each step counting the keys at or above the
 * middle 8 at a time (at most 32 steps). Then the keys above it and, in id order, the first ties
 * at it, as the ranking above picks them. Returns the count, or 0 (nothing chosen) where a logit is
 * NaN. For a small vocabulary the heap took most of a draw (at vocab 257, k = 50 about a third of
 * the logits enter it, each a mispredicted walk down); past a few thousand its one predictable
 * comparison per logit is cheaper than the counting passes. */
#define THRESHOLD_VOCAB 4096
static int64_t select_top_k_small(const float *row, int64_t vocab, int64_t top_k, float *values, int64_t *ids) {
    int32_t keys[THRESHOLD_VOCAB + 8] __attribute__((aligned(32)));
    const int64_t padded = (vocab + 7) / 8 * 8;
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i low = _mm256_set1_epi32(INT32_MAX), high = _mm256_set1_epi32(INT32_MIN);
    __m256 nan = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
        const __m256i lanes = first_lanes(vocab - j > 8 ? 8 : vocab - j);
        const __m256 v = _mm256_add_ps(_mm256_maskload_ps(row + j, lanes), _mm256_setzero_ps());  /* -0 as +0 */
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256i bits = _mm256_castps_si256(v);
        __m256i key = _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31), magnitude));
        key = _mm256_blendv_epi8(_mm256_set1_epi32(INT32_MIN), key, lanes);  /* padding: below every logit */
        _mm256_store_si256((__m256i *)(keys + j), key);
        low = _mm256_min_epi32(low, _mm256_blendv_epi8(_mm256_set1_epi32(INT32_MAX), key, lanes));
        high = _mm256_max_epi32(high, key);
    }
    if (_mm256_movemask_ps(nan)) return 0;
    int32_t lanes_low[8], lanes_high[8];
    _mm256_storeu_si256((__m256i *)lanes_low, low);
    _mm256_storeu_si256((__m256i *)lanes_high, high);
    int64_t lo = INT32_MAX, hi = INT32_MIN;  /* invariant: >= top_k keys at or above lo, fewer at or above hi */
    for (int i = 0; i < 8; i++) {
        lo = lanes_low[i] < lo ? lanes_low[i] : lo;
        hi = lanes_high[i] > hi ? lanes_high[i] : hi;
    }
    hi += 1;
    while (hi - lo > 1) {
        const int64_t middle = lo + (hi - lo) / 2;
        const __m256i bound = _mm256_set1_epi32((int32_t)middle);
        __m256i below = _mm256_setzero_si256();
        for (int64_t j = 0; j < padded; j += 8)
            below = _mm256_sub_epi32(below, _mm256_cmpgt_epi32(bound, _mm256_load_si256((const __m256i *)(keys + j))));
        if (padded - lanes_sum_epi32(below) >= top_k) lo = middle;
        else hi = middle;
    }
    const int32_t kth = (int32_t)lo;
    int64_t n = 0;
    for (int64_t t = 0; t < vocab; t++)
        if (keys[t] > kth) {
            values[n] = row[t];
            ids[n++] = t;
        }
    for (int64_t t = 0; t < vocab && n < top_k; t++)
        if (keys[t] == kth) {
            values[n] = row[t];
            ids[n++] = t;
        }
    return n;
}

/* The top_k best of a row of vocab logits into values and ids as a heap with the lowest-ranked at
 * the root: a later token enters only above it (a tie with it ranks below, by its higher id).
 * Returns the count. */
static int64_t select_top_k_heap(const float *row, int64_t vocab, int64_t top_k, float *values, int64_t *ids) {
    int64_t n = 0;
    for (int64_t t = 0; t < vocab; t++) {
        const float v = row[t];
        if (n < top_k) {
            int64_t at = n++;
            values[at] = v;
            ids[at] = t;
            while (at > 0 && ranks_below(values[at], ids[at], values[(at - 1) / 2], ids[(at - 1) / 2])) {
                swap_candidates(values, ids, at, (at - 1) / 2);
                at = (at - 1) / 2;
            }
        } else if (v > values[0]) {
            values[0] = v;
            ids[0] = t;
            sift_down(values, ids, n, 0);
        }
    }
    return n;
}

/* select_top_k_heap's heap of n candidates sorted best first. */
static void heap_sort(float *values, int64_t *ids, int64_t n) {
    for (int64_t end = n - 1; end > 0; end--) {
        swap_candidates(values, ids, 0, end);
        sift_down(values, ids, end, 0);
    }
}

void comlrl_draw_tokens(int64_t rows, int64_t vocab, const float *logits, int64_t ld, const float *uniforms,
                        int64_t top_k, float temperature, float top_p, int64_t *out, float *values, int64_t *ids,
                        float *cdf) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * ld;
        /* The top k, best first. A small vocabulary's by bisection and rank counting (a 32-row draw
         * at vocab 257, k = 50 on an AVX2 EPYC: ~240-260 -> ~66-70 us, the same tokens); otherwise, or
         * where a logit is NaN, through a heap, sorted by counting ranks where they can be counted. */
        int64_t n = vocab <= THRESHOLD_VOCAB && top_k <= RANK_SORT_MAX ?
                    select_top_k_small(row, vocab, top_k, values, ids) : 0;
        if (n) {
            rank_sort(values, ids, n);  /* no NaN among them, so it sorts */
        } else {
            n = select_top_k_heap(row, vocab, top_k, values, ids);
            if (n > RANK_SORT_MAX || vocab > INT32_MAX || !rank_sort(values, ids, n)) heap_sort(values, ids, n);
        }
        /* From here on ascending, as torch.topk's output flipped: position i holds the (n-1-i)-th best. */
        const float best = values[0] / temperature;
        float total = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            cdf[i] = expf(values[n - 1 - i] / temperature - best);
            total += cdf[i];
        }
        int64_t first = 0;  /* top-p: drop the least likely while their mass stays <= 1 - top_p */
        if (top_p < 1.0f) {
            float running = 0.0f;
            while (first < n - 1) {
                running += cdf[first];
                if (!(running / total <= 1.0f - top_p)) break;
                first++;
            }
        }
        float kept = 0.0f;
        for (int64_t i = first; i < n; i++) {
            kept += cdf[i];
            cdf[i] = kept;
        }
        const float target = uniforms[r] * kept;
        int64_t pick = first;
        while (pick < n - 1 && !(cdf[pick] > target)) pick++;
        out[r] = ids[n - 1 - pick];
    }
}

/* Rows of d floats between layouts (the training attention's blocked copies): dst row i = src row
 * index[i] (gather), or dst row index[i] = src row i (scatter). A memcpy per row: torch's
 * index_select / index_copy_ and its copies through permuted views took 3-10x as long on these
 * rows of 64 floats. */
void comlrl_gather_rows(int64_t count, int64_t d, const float *src, const int64_t *index, float *dst) {
    for (int64_t i = 0; i < count; i++) memcpy(dst + i * d, src + index[i] * d, (size_t)d * sizeof(float));
}

void comlrl_scatter_rows(int64_t count, int64_t d, const float *src, const int64_t *index, float *dst) {
    for (int64_t i = 0; i < count; i++) memcpy(dst + index[i] * d, src + i * d, (size_t)d * sizeof(float));
}

/* The training pass's rotary embedding (`training_ops.rotary`): out (rows x heads x dim,
 * contiguous) = x (row r at x + r * x_row_stride, heads of dim contiguous) with each head's pair p
 * = (x[2p], x[2p + 1]) times rotation[r][p] = (cos, sin) as a complex product, or times its
 * conjugate (cos, -sin) with `conjugate` (the backward pass: the rotation is unitary). */
void comlrl_rotate(int64_t rows, int64_t heads, int64_t dim, const float *x, int64_t x_row_stride,
                   const float *rotation, int64_t conjugate, float *out) {
    const int64_t half = dim / 2;
    const float sign = conjugate ? -1.0f : 1.0f;
    for (int64_t r = 0; r < rows; r++) {
        const float *rot = rotation + r * dim;
        for (int64_t h = 0; h < heads; h++)
            rotate_head(x + r * x_row_stride + h * dim, rot, sign, half, out + (r * heads + h) * dim);
    }
}

/* ------------------------------------------------------------------------------------------------
 * The training pass's attention softmax (`training_ops.shared_prefix_attention`). Scores come from
 * batched matmuls in blocks; row i of block b is one query (its position p = i % period) and has
 * two parts: `width` columns against the prompt's keys (prefix: row at prefix + (b * rows + i) *
 * width, additive bias row at bias + (b / bias_div) * bias_block_stride + p * bias_row_stride) and
 * `own_len` columns against the row's own tokens (own: row at own + (b * rows + i) * own_len, 0
 * columns for a prompt's queries), of which the first p + 1 are seen (causal) and the rest are 0
 * in the probabilities. One softmax spans both parts; the probabilities overwrite the scores, so
 * no concatenation, bias tensor or mask pass is made.
 */

/* x[0 .. n-1] = x * scale + (bias ? bias : 0), the running maximum updated (masked tail). */
static inline __m256 scale_bias_max(float *x, const float *bias, int64_t n, __m256 scale, __m256 vmax) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 s = _mm256_loadu_ps(x + j);
        s = bias ? _mm256_fmadd_ps(s, scale, _mm256_loadu_ps(bias + j)) : _mm256_mul_ps(s, scale);
        _mm256_storeu_ps(x + j, s);
        vmax = _mm256_max_ps(vmax, s);
    }
    if (j < n) {
        const __m256i mask = first_lanes(n - j);
        __m256 s = _mm256_maskload_ps(x + j, mask);
        s = bias ? _mm256_fmadd_ps(s, scale, _mm256_maskload_ps(bias + j, mask)) : _mm256_mul_ps(s, scale);
        _mm256_maskstore_ps(x + j, mask, s);
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(mask)));
    }
    return vmax;
}

void comlrl_attention_softmax(int64_t blocks, int64_t rows, int64_t period, float *prefix, int64_t width,
                              const float *bias, int64_t bias_div, int64_t bias_block_stride, int64_t bias_row_stride,
                              float *own, int64_t own_len, float scale) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t b = 0; b < blocks; b++) {
        const float *block_bias = bias + (b / bias_div) * bias_block_stride;
        for (int64_t i = 0; i < rows; i++) {
            const int64_t position = i % period, row = b * rows + i;
            float *p = prefix + row * width, *o = own_len ? own + row * own_len : 0;
            const int64_t seen = o ? position + 1 : 0;
            __m256 vmax = scale_bias_max(p, block_bias + position * bias_row_stride, width, vscale,
                                         _mm256_set1_ps(-INFINITY));
            if (seen) vmax = scale_bias_max(o, 0, seen, vscale, vmax);
            const __m256 shift = _mm256_set1_ps(lanes_max(vmax));
            __m256 vsum = exp_shifted_sum(p, width, shift, _mm256_setzero_ps());
            if (seen) vsum = exp_shifted_sum(o, seen, shift, vsum);
            const float inverse = 1.0f / lanes_sum(vsum);
            scale_in_place(p, width, inverse);
            if (o) {
                scale_in_place(o, seen, inverse);
                memset(o + seen, 0, (size_t)(own_len - seen) * sizeof(float));
            }
        }
    }
}

/* Sum over j < n of probs[j] * grad[j] (8 lanes, masked tail). */
static inline __m256 dot_lanes(const float *probs, const float *grad, int64_t n, __m256 acc) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(probs + j), _mm256_loadu_ps(grad + j), acc);
    if (j < n) {
        const __m256i mask = first_lanes(n - j);
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(probs + j, mask), _mm256_maskload_ps(grad + j, mask), acc);
    }
    return acc;
}

/* grad[j] = probs[j] * (grad[j] - dot) * scale for j < n. */
static inline void softmax_grad(const float *probs, float *grad, int64_t n, float dot, float scale) {
    const __m256 vdot = _mm256_set1_ps(dot), vscale = _mm256_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(grad + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(probs + j),
                                                               _mm256_sub_ps(_mm256_loadu_ps(grad + j), vdot)), vscale));
    for (; j < n; j++) grad[j] = probs[j] * (grad[j] - dot) * scale;
}

/* The backward pass of comlrl_attention_softmax with the layout above: given the probabilities and
 * the gradient with respect to them (overwritten), the gradient with respect to the raw scores,
 * probs * (grad - sum(probs * grad)) * scale; 0 at the own columns a query does not see. */
void comlrl_attention_softmax_backward(int64_t blocks, int64_t rows, int64_t period, const float *prefix_probs,
                                       float *prefix_grad, int64_t width, const float *own_probs, float *own_grad,
                                       int64_t own_len, float scale) {
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i = 0; i < rows; i++) {
            const int64_t row = b * rows + i, seen = own_len ? i % period + 1 : 0;
            const float *pp = prefix_probs + row * width, *op = own_len ? own_probs + row * own_len : 0;
            float *pg = prefix_grad + row * width, *og = own_len ? own_grad + row * own_len : 0;
            __m256 acc = dot_lanes(pp, pg, width, _mm256_setzero_ps());
            if (seen) acc = dot_lanes(op, og, seen, acc);
            const float dot = lanes_sum(acc);
            softmax_grad(pp, pg, width, dot, scale);
            if (og) {
                softmax_grad(op, og, seen, dot, scale);
                memset(og + seen, 0, (size_t)(own_len - seen) * sizeof(float));
            }
        }
}

/* ------------------------------------------------------------------------------------------------
 * A linear layer's weight gradient on AVX-512 CPUs: c (n x m, row stride ldc) = g^T x for the output
 * gradient g (t x n, row stride ldg) and the input x (t x m, row stride ldx), both read in place.
 * oneDNN wants both operands transposed and copies them first (a (t x 1024) gradient's copy reads
 * rows 4 KB apart); here each token is one step of an outer product: for a block of 16 outputs and
 * 16 inputs, c[o][.] += g[s][o] * x[s][.] over the tokens s in order, 16 sums in 16 registers, as
 * the decode panel kernel does with its rows. The 16 gradient columns and the inputs are copied into
 * 16-wide panels first (64-byte pieces, sequential), so the kernel streams both; tokens go in chunks
 * of GW_TOKENS, whose input panels stay in L2 for every output block, and each chunk's sums start
 * from the previous chunk's (the order of the sums is the tokens' order whatever the chunking).
 */
#define GW_TOKENS 256
#define GW_INIT(r) __m512 c##r = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, c + (r) * ldc);
#define GW_FMA(r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(gs[r]), b, c##r);
#define GW_STORE(r) if ((r) < rows) _mm512_mask_storeu_ps(c + (r) * ldc, mask, c##r);

static AVX512 void grad_weight_block(int64_t tokens, const float *gp, const float *xp, float *c, int64_t ldc,
                                     int rows, __mmask16 mask, int first) {
    R16(GW_INIT)
    for (int64_t s = 0; s < tokens; s++) {
        const float *gs = gp + s * NR16;
        const __m512 b = _mm512_load_ps(xp + s * NR16);
        R16(GW_FMA)
    }
    R16(GW_STORE)
}

/* Copies columns [c0, c0 + cols) of `tokens` rows of a (row stride ld) into a 16-wide panel, zeros past cols. */
static AVX512 void pack_columns(int64_t tokens, const float *a, int64_t ld, int64_t c0, int cols, float *panel) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    for (int64_t s = 0; s < tokens; s++)
        _mm512_store_ps(panel + s * NR16, _mm512_maskz_loadu_ps(mask, a + s * ld + c0));
}

/* Returns 0, or -1 (c untouched) when the panels cannot be allocated. */
int comlrl_grad_weight(int64_t t, int64_t n, int64_t m, const float *g, int64_t ldg, const float *x, int64_t ldx,
                       float *c, int64_t ldc) {
    const int64_t chunk = t < GW_TOKENS ? t : GW_TOKENS, in_blocks = (m + NR16 - 1) / NR16;
    float *xp = aligned_alloc(64, (size_t)((in_blocks + 1) * (chunk ? chunk : 1) * NR16) * sizeof(float));
    if (!xp) return -1;
    float *gp = xp + in_blocks * (chunk ? chunk : 1) * NR16;
    if (t == 0) {
        for (int64_t o = 0; o < n; o++) memset(c + o * ldc, 0, (size_t)m * sizeof(float));
    }
    for (int64_t s0 = 0; s0 < t; s0 += chunk) {
        const int64_t tokens = t - s0 < chunk ? t - s0 : chunk;
        for (int64_t i = 0; i < in_blocks; i++) {
            const int cols = m - i * NR16 < NR16 ? (int)(m - i * NR16) : NR16;
            pack_columns(tokens, x + s0 * ldx, ldx, i * NR16, cols, xp + i * tokens * NR16);
        }
        for (int64_t o0 = 0; o0 < n; o0 += NR16) {
            const int rows = n - o0 < NR16 ? (int)(n - o0) : NR16;
            pack_columns(tokens, g + s0 * ldg, ldg, o0, rows, gp);
            for (int64_t i = 0; i < in_blocks; i++) {
                const int cols = m - i * NR16 < NR16 ? (int)(m - i * NR16) : NR16;
                grad_weight_block(tokens, gp, xp + i * tokens * NR16, c + o0 * ldc + i * NR16, ldc, rows,
                                  (__mmask16)((1u << cols) - 1u), s0 == 0);
            }
        }
    }
    free(xp);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * The training attention's products over each row's own tokens (`training_ops.shared_prefix_attention`),
 * on AVX-512 CPUs. Block b holds `rows` queries, a KV head's query heads one after another with
 * `period` positions each (row i sits at position i % period), against the row's `period` own keys
 * and values of `dim` floats. Position p sees keys 0 .. p only, so each product runs over its causal
 * half: torch.bmm multiplies every column of these small blocks (63 x 64 at the L benchmark's
 * shape), half of them masked, at well under the core's peak. The probabilities and the score
 * gradients are 0 past a row's position (`comlrl_attention_softmax` and its backward write them),
 * so a product over keys may run to the end of a group of rows and add exact zeros.
 * ------------------------------------------------------------------------------------------------ */
#define OWN_ROWS 4

static inline int64_t own_last_position(int64_t i0, int64_t count, int64_t period) {
    int64_t last = 0;
    for (int64_t i = i0; i < i0 + count; i++) last = i % period > last ? i % period : last;
    return last;
}

/* Rows i0 .. i0 + count - 1 of block b (count = min(group, rows - i0), returned) as `group` row
 * pointers into a (row stride lda) and c (row stride ldc); those past the last row repeat it (its
 * sums are computed again and not stored). */
static int own_row_group(int64_t b, int64_t rows, int64_t i0, int group, const float *a, int64_t lda, float *c,
                         int64_t ldc, const float **a_rows, float **c_rows) {
    const int count = rows - i0 < group ? (int)(rows - i0) : group;
    for (int r = 0; r < group; r++) {
        const int64_t i = b * rows + i0 + (r < count ? r : count - 1);
        a_rows[r] = a + i * lda;
        c_rows[r] = c + i * ldc;
    }
    return count;
}

/* A block's keys (period x dim) transposed into kt (dim x ldk, ldk = period rounded up to 16), zero
 * past the period, for the scores kernels to read 16 columns at a time. own_keys_scratch allocates
 * kt (NULL when it cannot). */
static float *own_keys_scratch(int64_t period, int64_t dim, int64_t *ldk) {
    *ldk = (period + 15) / 16 * 16;
    return aligned_alloc(64, (size_t)(dim * *ldk * 4 + 63) / 64 * 64 + 64);
}

static void own_transpose_keys(const float *kb, int64_t period, int64_t dim, int64_t ldk, float *kt) {
    for (int64_t d = 0; d < dim; d++)
        for (int64_t j = 0; j < ldk; j++) kt[d * ldk + j] = j < period ? kb[j * dim + d] : 0.0f;
}

/* c[r][jb * 16 ..] = sum_d a[r][d] * kt[d][jb * 16 ..] for 4 rows and NJ 16-column blocks. */
#define OWN_SCORES_KERNEL(NJ) \
static AVX512 void own_scores_##NJ(int64_t dim, const float *const a[OWN_ROWS], const float *kt, int64_t ldk, \
                                   float *const c[OWN_ROWS], int rows, const __mmask16 *masks) { \
    __m512 acc[OWN_ROWS][NJ]; \
    for (int r = 0; r < OWN_ROWS; r++) for (int j = 0; j < NJ; j++) acc[r][j] = _mm512_setzero_ps(); \
    for (int64_t d = 0; d < dim; d++) { \
        __m512 keys[NJ]; \
        for (int j = 0; j < NJ; j++) keys[j] = _mm512_load_ps(kt + d * ldk + j * 16); \
        for (int r = 0; r < OWN_ROWS; r++) { \
            const __m512 x = _mm512_set1_ps(a[r][d]); \
            for (int j = 0; j < NJ; j++) acc[r][j] = _mm512_fmadd_ps(x, keys[j], acc[r][j]); \
        } \
    } \
    for (int r = 0; r < OWN_ROWS; r++) /* constant bounds: the sums stay in registers */ \
        if (r < rows) for (int j = 0; j < NJ; j++) _mm512_mask_storeu_ps(c[r] + j * 16, masks[j], acc[r][j]); \
}
OWN_SCORES_KERNEL(1) OWN_SCORES_KERNEL(2) OWN_SCORES_KERNEL(3) OWN_SCORES_KERNEL(4)

/* masks[b]: the lanes of 16-wide block b of the 64 columns from d0 that lie below n. */
static AVX512 void own_chunk_masks(int64_t n, int64_t d0, __mmask16 masks[4]) {
    for (int d = 0; d < 4; d++) {
        const int64_t left = n - d0 - d * 16;
        masks[d] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
    }
}

/* scores (blocks, rows, period) = q (blocks, rows, dim) . keys (blocks, period, dim)^T at the columns
 * a row sees, in whole 16-column blocks (the columns past its position within its last block get
 * values the softmax does not read; those past that block are not written). Returns -1 (nothing
 * written) when the scratch cannot be allocated. */
int comlrl_own_scores(int64_t blocks, int64_t rows, int64_t period, int64_t dim, const float *q, const float *keys,
                      float *scores) {
    int64_t ldk;
    float *kt = own_keys_scratch(period, dim, &ldk);
    if (!kt) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        own_transpose_keys(keys + b * period * dim, period, dim, ldk, kt);
        for (int64_t i0 = 0; i0 < rows; i0 += OWN_ROWS) {
            const float *a[OWN_ROWS];
            float *c[OWN_ROWS];
            const int count = own_row_group(b, rows, i0, OWN_ROWS, q, dim, scores, period, a, c);
            const int64_t needed = own_last_position(i0, count, period) / 16 + 1;
            for (int64_t jb = 0; jb < needed; jb += 4) {
                const int nj = needed - jb < 4 ? (int)(needed - jb) : 4;
                __mmask16 masks[4];
                float *cj[OWN_ROWS];
                own_chunk_masks(period, jb * 16, masks);
                for (int r = 0; r < OWN_ROWS; r++) cj[r] = c[r] + jb * 16;
                switch (nj) {
                    case 1: own_scores_1(dim, a, kt + jb * 16, ldk, cj, count, masks); break;
                    case 2: own_scores_2(dim, a, kt + jb * 16, ldk, cj, count, masks); break;
                    case 3: own_scores_3(dim, a, kt + jb * 16, ldk, cj, count, masks); break;
                    default: own_scores_4(dim, a, kt + jb * 16, ldk, cj, count, masks); break;
                }
            }
        }
    }
    free(kt);
    return 0;
}

/* c[r][dc * 16 ..] = sum over j < keys of p[r][j] * v[j][dc * 16 ..] for 4 rows and ND 16-float chunks
 * of dim (masks: the chunks' lanes in dim). */
#define OWN_WEIGHTED_KERNEL(ND) \
static AVX512 void own_weighted_##ND(int64_t keys, const float *const p[OWN_ROWS], const float *v, int64_t ldv, \
                                     float *const c[OWN_ROWS], int rows, const __mmask16 *masks) { \
    __m512 acc[OWN_ROWS][ND]; \
    for (int r = 0; r < OWN_ROWS; r++) for (int d = 0; d < ND; d++) acc[r][d] = _mm512_setzero_ps(); \
    for (int64_t j = 0; j < keys; j++) { \
        __m512 values[ND]; \
        for (int d = 0; d < ND; d++) values[d] = _mm512_maskz_loadu_ps(masks[d], v + j * ldv + d * 16); \
        for (int r = 0; r < OWN_ROWS; r++) { \
            const __m512 x = _mm512_set1_ps(p[r][j]); \
            for (int d = 0; d < ND; d++) acc[r][d] = _mm512_fmadd_ps(x, values[d], acc[r][d]); \
        } \
    } \
    for (int r = 0; r < OWN_ROWS; r++) \
        if (r < rows) for (int d = 0; d < ND; d++) _mm512_mask_storeu_ps(c[r] + d * 16, masks[d], acc[r][d]); \
}
OWN_WEIGHTED_KERNEL(1) OWN_WEIGHTED_KERNEL(2) OWN_WEIGHTED_KERNEL(3) OWN_WEIGHTED_KERNEL(4)

/* out (blocks, rows, dim) = p (blocks, rows, period) . values (blocks, period, dim): each row's sum over
 * the keys it sees (p is 0 past them), the probabilities times the values or the score gradients
 * times the keys. */
void comlrl_own_weighted(int64_t blocks, int64_t rows, int64_t period, int64_t dim, const float *p, const float *values,
                         float *out) {
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i0 = 0; i0 < rows; i0 += OWN_ROWS) {
            const float *pr[OWN_ROWS];
            float *c[OWN_ROWS];
            const int count = own_row_group(b, rows, i0, OWN_ROWS, p, period, out, dim, pr, c);
            const int64_t keys = own_last_position(i0, count, period) + 1;
            for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                __mmask16 masks[4];
                float *cd[OWN_ROWS];
                own_chunk_masks(dim, d0, masks);
                for (int r = 0; r < OWN_ROWS; r++) cd[r] = c[r] + d0;
                const float *v = values + b * period * dim + d0;
                switch ((dim - d0 + 15) / 16) {
                    case 1: own_weighted_1(keys, pr, v, dim, cd, count, masks); break;
                    case 2: own_weighted_2(keys, pr, v, dim, cd, count, masks); break;
                    case 3: own_weighted_3(keys, pr, v, dim, cd, count, masks); break;
                    default: own_weighted_4(keys, pr, v, dim, cd, count, masks); break;
                }
            }
        }
}

/* c[j][0 .. 63] (+)= sum over `count` consecutive rows i of p[i][j] * x[i][0 .. 63] for 4 keys (c[j]:
 * the output rows, a scratch row for keys past the last one; masks: which of the 64 dims exist),
 * the 16 sums in named registers (kept in arrays, GCC stored them to memory every row); with
 * `accumulate` the sums start from c's. */
#define OT_INIT(j, d) __m512 a##j##d = accumulate ? _mm512_maskz_loadu_ps(masks[d], c[j] + d * 16) : _mm512_setzero_ps();
#define OT_FMA(j, d) a##j##d = _mm512_fmadd_ps(w##j, x##d, a##j##d);
#define OT_STORE(j, d) _mm512_mask_storeu_ps(c[j] + d * 16, masks[d], a##j##d);
#define OT_KEY(M, j) M(j, 0) M(j, 1) M(j, 2) M(j, 3)
#define OT_ALL(M) OT_KEY(M, 0) OT_KEY(M, 1) OT_KEY(M, 2) OT_KEY(M, 3)
static AVX512 void own_transposed_keys(int64_t count, const float *p, int64_t ldp, const float *x, int64_t ldx,
                                       float *const c[OWN_ROWS], const __mmask16 *masks, int accumulate) {
    OT_ALL(OT_INIT)
    for (int64_t n = 0; n < count; n++) {
        const float *pi = p + n * ldp, *xi = x + n * ldx;
        const __m512 x0 = _mm512_maskz_loadu_ps(masks[0], xi), x1 = _mm512_maskz_loadu_ps(masks[1], xi + 16);
        const __m512 x2 = _mm512_maskz_loadu_ps(masks[2], xi + 32), x3 = _mm512_maskz_loadu_ps(masks[3], xi + 48);
        const __m512 w0 = _mm512_set1_ps(pi[0]), w1 = _mm512_set1_ps(pi[1]);
        const __m512 w2 = _mm512_set1_ps(pi[2]), w3 = _mm512_set1_ps(pi[3]);
        OT_ALL(OT_FMA)
    }
    OT_ALL(OT_STORE)
}

/* out (blocks, period, dim) = p (blocks, rows, period)^T . x (blocks, rows, dim): key j's sum over the
 * rows that see it (position >= j; p is 0 elsewhere), the values' and the keys' gradients. Four
 * keys' weights are read from a row at a time, so p must be readable 3 floats past its end (the
 * sums of keys past `period` are not stored). */
void comlrl_own_transposed(int64_t blocks, int64_t rows, int64_t period, int64_t dim, const float *p, const float *x,
                           float *out) {
    float scratch[64] __attribute__((aligned(64))) = {0};  /* the sums of keys past the last, 64 dims a pass */
    const int64_t heads = rows / period;
    for (int64_t b = 0; b < blocks; b++) {
        const float *pb = p + b * rows * period, *xb = x + b * rows * dim;
        float *ob = out + b * period * dim;
        for (int64_t j0 = 0; j0 < period; j0 += OWN_ROWS) {
            const int keys = period - j0 < OWN_ROWS ? (int)(period - j0) : OWN_ROWS;
            for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                __mmask16 masks[4];
                own_chunk_masks(dim, d0, masks);
                float *c[OWN_ROWS];
                for (int j = 0; j < OWN_ROWS; j++) c[j] = j < keys ? ob + (j0 + j) * dim + d0 : scratch;
                for (int64_t h = 0; h < heads; h++) {  /* the head's rows at positions j0 on */
                    const int64_t i = h * period + j0, count = period - j0;
                    const float *ph = pb + i * period + j0, *xh = xb + i * dim + d0;
                    own_transposed_keys(count, ph, period, xh, dim, c, masks, h > 0);
                }
            }
        }
    }
}

/* The same three products on AVX2 CPUs, 8-lane registers: a tile of 6 rows (or keys) x 16 columns
 * keeps 12 sums in flight (the FMA units' latency needs 8), each sum over the same terms in the same
 * order as the AVX-512 kernels', so the results are theirs bit for bit. The scores are written in
 * the same whole 16-column blocks. Lanes past `period` or `dim` are masked at the edges only. */
#define OWN2_ROWS 6
#define OWN2_SUMS(M) M(0) M(1) M(2) M(3) M(4) M(5)
#define OWN2_INIT(r) __m256 s##r##l = _mm256_setzero_ps(), s##r##h = _mm256_setzero_ps();
#define OWN2_FMA(r, W) { const __m256 w = _mm256_broadcast_ss(W); \
    s##r##l = _mm256_fmadd_ps(w, low, s##r##l); s##r##h = _mm256_fmadd_ps(w, high, s##r##h); }
#define OWN2_STORE(r) if (r < rows) { \
    if (full) { _mm256_storeu_ps(c[r], s##r##l); _mm256_storeu_ps(c[r] + 8, s##r##h); } \
    else { _mm256_maskstore_ps(c[r], m0, s##r##l); _mm256_maskstore_ps(c[r] + 8, m1, s##r##h); } }

/* The lanes of columns n0 .. n0 + 15 that lie below n, as two 8-lane masks; whether all 16 do. */
static inline int own2_masks(int64_t n, int64_t n0, __m256i *m0, __m256i *m1) {
    const int64_t left = n - n0;
    *m0 = first_lanes(left < 0 ? 0 : left > 8 ? 8 : left);
    *m1 = first_lanes(left < 8 ? 0 : left > 16 ? 8 : left - 8);
    return left >= 16;
}

/* c[r][0 .. 15] = sum_d a[r][d] * kt[d][0 .. 15] for up to 6 rows (kt's 16 columns padded: always read). */
static void own2_scores_tile(int64_t dim, const float *const a[OWN2_ROWS], const float *kt, int64_t ldk,
                             float *const c[OWN2_ROWS], int rows, int full, __m256i m0, __m256i m1) {
    OWN2_SUMS(OWN2_INIT)
    for (int64_t d = 0; d < dim; d++) {
        const __m256 low = _mm256_load_ps(kt + d * ldk), high = _mm256_load_ps(kt + d * ldk + 8);
#define OWN2_SCORE_FMA(r) OWN2_FMA(r, a[r] + d)
        OWN2_SUMS(OWN2_SCORE_FMA)
    }
    OWN2_SUMS(OWN2_STORE)
}

int comlrl_own_scores_avx2(int64_t blocks, int64_t rows, int64_t period, int64_t dim, const float *q,
                           const float *keys, float *scores) {
    int64_t ldk;
    float *kt = own_keys_scratch(period, dim, &ldk);
    if (!kt) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        own_transpose_keys(keys + b * period * dim, period, dim, ldk, kt);
        for (int64_t i0 = 0; i0 < rows; i0 += OWN2_ROWS) {
            const float *a[OWN2_ROWS];
            float *c[OWN2_ROWS];
            const int count = own_row_group(b, rows, i0, OWN2_ROWS, q, dim, scores, period, a, c);
            const int64_t needed = own_last_position(i0, count, period) / 16 + 1;
            for (int64_t jb = 0; jb < needed; jb++) {
                __m256i m0, m1;
                const int full = own2_masks(period, jb * 16, &m0, &m1);
                float *cj[OWN2_ROWS];
                for (int r = 0; r < OWN2_ROWS; r++) cj[r] = c[r] + jb * 16;
                own2_scores_tile(dim, a, kt + jb * 16, ldk, cj, count, full, m0, m1);
            }
        }
    }
    free(kt);
    return 0;
}

/* c[r][0 .. 15] = sum over j < keys of p[r][j] * v[j][0 .. 15] for up to 6 rows (m0, m1: the 16
 * floats' lanes in dim; masked loads only where not `full`). */
static void own2_weighted_tile(int64_t keys, const float *const p[OWN2_ROWS], const float *v, int64_t ldv,
                               float *const c[OWN2_ROWS], int rows, int full, __m256i m0, __m256i m1) {
    OWN2_SUMS(OWN2_INIT)
    for (int64_t j = 0; j < keys; j++) {
        const float *vj = v + j * ldv;
        const __m256 low = full ? _mm256_loadu_ps(vj) : _mm256_maskload_ps(vj, m0);
        const __m256 high = full ? _mm256_loadu_ps(vj + 8) : _mm256_maskload_ps(vj + 8, m1);
#define OWN2_WEIGHT_FMA(r) OWN2_FMA(r, p[r] + j)
        OWN2_SUMS(OWN2_WEIGHT_FMA)
    }
    OWN2_SUMS(OWN2_STORE)
}

void comlrl_own_weighted_avx2(int64_t blocks, int64_t rows, int64_t period, int64_t dim, const float *p,
                              const float *values, float *out) {
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i0 = 0; i0 < rows; i0 += OWN2_ROWS) {
            const float *pr[OWN2_ROWS];
            float *c[OWN2_ROWS];
            const int count = own_row_group(b, rows, i0, OWN2_ROWS, p, period, out, dim, pr, c);
            const int64_t keys = own_last_position(i0, count, period) + 1;
            for (int64_t d0 = 0; d0 < dim; d0 += 16) {
                __m256i m0, m1;
                const int full = own2_masks(dim, d0, &m0, &m1);
                float *cd[OWN2_ROWS];
                for (int r = 0; r < OWN2_ROWS; r++) cd[r] = c[r] + d0;
                own2_weighted_tile(keys, pr, values + b * period * dim + d0, dim, cd, count, full, m0, m1);
            }
        }
}

/* c[j][0 .. 15] (+)= sum over `count` consecutive rows n of p[n][j] * x[n][0 .. 15] for 6 keys (c[j]:
 * a scratch row for keys past the last one); with `accumulate` the sums start from c's. */
static void own2_transposed_tile(int64_t count, const float *p, int64_t ldp, const float *x, int64_t ldx,
                                 float *const c[OWN2_ROWS], int full, __m256i m0, __m256i m1, int accumulate) {
    const int rows = OWN2_ROWS;
#define OWN2_LOAD(r) __m256 s##r##l = _mm256_setzero_ps(), s##r##h = _mm256_setzero_ps(); \
    if (accumulate) { s##r##l = _mm256_maskload_ps(c[r], m0); s##r##h = _mm256_maskload_ps(c[r] + 8, m1); }
    OWN2_SUMS(OWN2_LOAD)
    for (int64_t n = 0; n < count; n++) {
        const float *pn = p + n * ldp, *xn = x + n * ldx;
        const __m256 low = full ? _mm256_loadu_ps(xn) : _mm256_maskload_ps(xn, m0);
        const __m256 high = full ? _mm256_loadu_ps(xn + 8) : _mm256_maskload_ps(xn + 8, m1);
#define OWN2_KEY_FMA(r) OWN2_FMA(r, pn + r)
        OWN2_SUMS(OWN2_KEY_FMA)
    }
    OWN2_SUMS(OWN2_STORE)
}

/* As comlrl_own_transposed; p must be readable 5 floats past its end (six keys' weights a row). */
void comlrl_own_transposed_avx2(int64_t blocks, int64_t rows, int64_t period, int64_t dim, const float *p,
                                const float *x, float *out) {
    float scratch[16] __attribute__((aligned(64))) = {0};  /* the sums of keys past the last, 16 dims a tile */
    const int64_t heads = rows / period;
    for (int64_t b = 0; b < blocks; b++) {
        const float *pb = p + b * rows * period, *xb = x + b * rows * dim;
        float *ob = out + b * period * dim;
        for (int64_t j0 = 0; j0 < period; j0 += OWN2_ROWS) {
            const int keys = period - j0 < OWN2_ROWS ? (int)(period - j0) : OWN2_ROWS;
            for (int64_t d0 = 0; d0 < dim; d0 += 16) {
                __m256i m0, m1;
                const int full = own2_masks(dim, d0, &m0, &m1);
                float *c[OWN2_ROWS];
                for (int j = 0; j < OWN2_ROWS; j++) c[j] = j < keys ? ob + (j0 + j) * dim + d0 : scratch;
                for (int64_t h = 0; h < heads; h++) {  /* the head's rows at positions j0 on */
                    const int64_t i = h * period + j0;
                    own2_transposed_tile(period - j0, pb + i * period + j0, period, xb + i * dim + d0, dim, c, full,
                                         m0, m1, h > 0);
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * A whole decode step in one call (lean.StackedLeanDecoder.step where every kernel above runs):
 * the embedding rows, each layer's projections, rotary embedding + cache write, attention, residual
 * adds + norms and SwiGLU, and the LM head, in the order and with the functions the step's Python
 * path calls one by one, so the logits, the cache and the recorded projections are the same bit
 * for bit. The ~40 calls of a step cost 5-15 us each in Python around ~60-100 us of arithmetic per
 * layer; the plan below is built once per sampling call.
 * ------------------------------------------------------------------------------------------------ */

/* One projection of every agent: packed panels (agent a at packed + a * packed_stride), bias
 * padded to whole panels (NULL: none), panel width and family; `record`, when not NULL, is step
 * 0's (agents, rows, n) slice of a ProjectionRecord's steps, each step `agents * rows * n` floats on. */
typedef struct {
    const float *packed;
    int64_t packed_stride;
    const float *bias;
    int64_t bias_stride;
    int64_t width, avx512;
    float *record;
} StepProjection;

typedef struct {
    StepProjection qkv, o, gate_up, down;
    const float *prefix_keys, *prefix_values;  /* (prompts, kv, dim, width), (prompts, kv, width, dim) */
    float *keys, *values;                      /* (total rows, kv, dim, max_new), (total rows, kv, max_new, dim) */
    float eps, next_eps;                       /* the norms after the attention and after the MLP */
} StepLayer;

typedef struct {
    int64_t agents, rows, layers, hidden, heads, kv_heads, dim, intermediate, vocab, group_size, width, max_new;
    const float *embed;            /* (agents * vocab, hidden): agent a's token t at row a * vocab + t */
    StepProjection head;           /* the LM head (hidden -> vocab) */
    const float *attention_bias;   /* (total rows, >= width + max_new), additive */
    int64_t bias_stride;
    float scale, first_eps;
    float *work;                   /* comlrl_decode_step_work_floats(...) floats, 64-byte aligned */
    const StepLayer *layer;
} StepPlan;

static int64_t rounded16(int64_t floats) { return (floats + 15) / 16 * 16; }

/* The floats of a plan's work buffer: the hidden state, the normed input, each layer output, the
 * attention's scratch and the products' transposed inputs, each rounded to 64 bytes. */
int64_t comlrl_decode_step_work_floats(int64_t agents, int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads,
                                       int64_t dim, int64_t intermediate, int64_t width, int64_t max_new) {
    int64_t total = agents * rows, widest = hidden > heads * dim ? hidden : heads * dim;
    if (intermediate > widest) widest = intermediate;
    return 4 * rounded16(total * hidden) + rounded16(total * (heads + 2 * kv_heads) * dim) +
           rounded16(total * heads * dim) + rounded16(total * 2 * intermediate) + rounded16(total * intermediate) +
           rounded16(comlrl_decode_attention_scratch_floats(rows, heads / kv_heads, width, max_new)) +
           rounded16(transposed_floats6(rows, widest));  /* >= rows * widest, what the other families take */
}

/* A step's recorded outputs are read back only by the training pass, after the sampling call:
 * written through the caches, they pushed the weights the next products read out of L3 (each step
 * streams both agents' weights, ~19 MB for the medium model, past ~1 MB of records). So the
 * products write into the hot work buffers and their outputs are copied to the record with
 * non-temporal stores, once the layer no longer changes them. */
static void stream_copy(float *dst, const float *src, int64_t count) {
    int64_t i = 0;
    for (; i < count && ((uintptr_t)(dst + i) & 31); i++) dst[i] = src[i];
    for (; i + 8 <= count; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    for (; i < count; i++) dst[i] = src[i];
}

static void record_output(const StepProjection *p, int64_t step, int64_t per_step, const float *out) {
    if (p->record) stream_copy(p->record + step * per_step, out, per_step);
}

/* tokens: (agents * rows) ids, agent-major; rotation: (agents * rows, dim / 2) (cos, sin) pairs;
 * writes the step's keys and values at column `step` of each layer's cache and the logits
 * (agents * rows, vocab). Returns 0, or -1 (nothing written) for a token id outside the vocabulary. */
int comlrl_decode_step(const StepPlan *plan, const int64_t *tokens, const float *rotation, int64_t step,
                       float *logits) {
    const int64_t agents = plan->agents, rows = plan->rows, total = agents * rows, hidden = plan->hidden;
    const int64_t heads = plan->heads, kv_heads = plan->kv_heads, dim = plan->dim, inter = plan->intermediate;
    const int64_t qkv_n = (heads + 2 * kv_heads) * dim, q_n = heads * dim;
    for (int64_t r = 0; r < total; r++)
        if (tokens[r] < 0 || tokens[r] >= plan->vocab) return -1;
    float *w = plan->work;
    float *state = w;                                   w += rounded16(total * hidden);
    float *x = w;                                       w += rounded16(total * hidden);
    float *o = w;                                       w += rounded16(total * hidden);
    float *down = w;                                    w += rounded16(total * hidden);
    float *qkv = w;                                     w += rounded16(total * qkv_n);
    float *attended = w;                                w += rounded16(total * q_n);
    float *gate_up = w;                                 w += rounded16(total * 2 * inter);
    float *act = w;                                     w += rounded16(total * inter);
    float *scratch = w;
    w += rounded16(comlrl_decode_attention_scratch_floats(rows, heads / kv_heads, plan->width, plan->max_new));
    float *xt = w;
    for (int64_t r = 0; r < total; r++)
        memcpy(state + r * hidden, plan->embed + ((r / rows) * plan->vocab + tokens[r]) * hidden, hidden * sizeof(float));
    comlrl_residual_rms_norm(total, hidden, state, NULL, plan->first_eps, x);
    for (int64_t i = 0; i < plan->layers; i++) {
        const StepLayer *L = plan->layer + i;
        const StepProjection *p = &L->qkv;
        panel_product(agents, rows, qkv_n, hidden, x, rows * hidden, hidden, p->packed, p->packed_stride, p->bias,
                      p->bias_stride, qkv, rows * qkv_n, qkv_n, p->width, p->avx512, xt);
        comlrl_rotate_into_cache(total, heads, kv_heads, dim, qkv, qkv_n, rotation, L->keys, L->values,
                                 plan->max_new, step);
        comlrl_decode_attention(total, kv_heads, heads / kv_heads, dim, plan->group_size, qkv, qkv_n,
                                L->prefix_keys, L->prefix_values, plan->width, L->keys, L->values, plan->max_new,
                                step + 1, plan->attention_bias, plan->bias_stride, plan->scale, attended, scratch);
        p = &L->o;
        panel_product(agents, rows, hidden, q_n, attended, rows * q_n, q_n, p->packed, p->packed_stride, p->bias,
                      p->bias_stride, o, rows * hidden, hidden, p->width, p->avx512, xt);
        comlrl_residual_rms_norm(total, hidden, state, o, L->eps, x);
        p = &L->gate_up;
        panel_product(agents, rows, 2 * inter, hidden, x, rows * hidden, hidden, p->packed, p->packed_stride,
                      p->bias, p->bias_stride, gate_up, rows * 2 * inter, 2 * inter, p->width, p->avx512, xt);
        comlrl_silu_mul(total, inter, gate_up, act);
        p = &L->down;
        panel_product(agents, rows, hidden, inter, act, rows * inter, inter, p->packed, p->packed_stride, p->bias,
                      p->bias_stride, down, rows * hidden, hidden, p->width, p->avx512, xt);
        comlrl_residual_rms_norm(total, hidden, state, down, L->next_eps, x);
        record_output(&L->qkv, step, total * qkv_n, qkv);
        record_output(&L->o, step, total * hidden, o);
        record_output(&L->gate_up, step, total * 2 * inter, gate_up);
        record_output(&L->down, step, total * hidden, down);
    }
    _mm_sfence();
    const StepProjection *h = &plan->head;
    panel_product(agents, rows, plan->vocab, hidden, x, rows * hidden, hidden, h->packed, h->packed_stride, h->bias,
                  h->bias_stride, logits, rows * plan->vocab, plan->vocab, h->width, h->avx512, xt);
    return 0;
}
