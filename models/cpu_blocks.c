/* A GGUF's Q4_0 / Q4_1 / Q8_0 weights multiplied as they are stored, in float32 (models/cpu_blocks.py).

   A block is 32 weights along the input: Q4 w = d * q + m (q in 0..15; Q4_0's m is -8 d), Q8_0
   w = d * q (q in -127..127). Over a block, sum_j w_j x_j = d * sum_j q_j x_j + m * sum_j x_j, so
   each output sums d times its integer-weighted block sums, plus m times the block's input sum
   (one per input row and block, shared by every output). The products and sums are float32, as
   the dense path's: the results differ from it only in the order of the additions.

   Layout (the caller's tensors, all contiguous): x [rows, k] float32, y [rows, n] float32, and
   the weight as n rows of k / 32 blocks, each block one record (a decode step streams them once, in
   order, prefetching ahead): Q4 {float d, m; 16 bytes, weight j < 16 byte j's low nibble, weight
   16 + j its high nibble (GGUF's order)}, Q8 {float d; 32 int8}. k is a multiple of 32. Rows go 4
   at a time through each block, so a block's weights are unpacked once for up to 4 rows; outputs
   are split over `threads` OpenMP threads. */

#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BLOCKS_SIMD 1
#endif

#define BLOCK 32
#define ROWS 4
/* Bytes ahead of the block in hand that a step asks the memory for: one thread's loads alone
   leave DRAM idle between misses (3072 x 576 Q4, one row, weights not cached: 0.35 ms with no
   prefetch, 0.11 ms at 4 KiB). */
#define PREFETCH 4096

typedef struct {
    float d, m;
    uint8_t qs[16];
} q4_block;

typedef struct {
    float d;
    int8_t q[BLOCK];
} q8_block;

/* 1: AVX-512 (16 lanes), 2: AVX2 + FMA (8 lanes), 0: neither (then nothing else is built, and
   models/cpu_blocks.py leaves the form unavailable). */
int blocks_simd(void) {
#if defined(__AVX512F__)
    return 1;
#elif defined(BLOCKS_SIMD)
    return 2;
#else
    return 0;
#endif
}

#ifdef BLOCKS_SIMD
static void block_sums(const float *x, int64_t rows, int64_t k, float *xs) {
    int64_t nb = k / BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * BLOCK;
            float s = 0.0f;
            for (int j = 0; j < BLOCK; j++) s += v[j];
            xs[r * nb + b] = s;
        }
}

/* A block's 32 integers as NV vectors of floats (before d and m), in the block's order. */
#if defined(__AVX512F__)
typedef __m512 vec;
#define NV 2
#define LANES 16
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vfma _mm512_fmadd_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vhsum _mm512_reduce_add_ps

static inline void unpack_q4(const uint8_t *q, vec w[NV]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
}

static inline void unpack_q8(const int8_t *q, vec w[NV]) {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
}
#else
typedef __m256 vec;
#define NV 4
#define LANES 8
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps

static inline float vhsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void unpack_q4(const uint8_t *q, vec w[NV]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline void unpack_q8(const int8_t *q, vec w[NV]) {
    for (int i = 0; i < NV; i++)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
}
#endif

/* y[r][i] for rows r0 .. r0 + nr - 1 (nr <= ROWS) of one output's blocks (q4 or q8). */
static inline __attribute__((always_inline)) void dot_rows(const float *x, const float *xs, int64_t k,
                                                           int64_t r0, int nr, const q4_block *q4,
                                                           const q8_block *q8, float *out) {
    int64_t nb = k / BLOCK;
    vec acc[ROWS];
    float shift[ROWS];
    for (int r = 0; r < nr; r++) {
        acc[r] = vzero();
        shift[r] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        vec w[NV];
        float d, m = 0.0f;
        if (q4) {
            __builtin_prefetch((const char *)(q4 + b) + PREFETCH);
            unpack_q4(q4[b].qs, w);
            d = q4[b].d;
            m = q4[b].m;
        } else {
            __builtin_prefetch((const char *)(q8 + b) + PREFETCH);
            unpack_q8(q8[b].q, w);
            d = q8[b].d;
        }
        vec scale = vset1(d);
        for (int r = 0; r < nr; r++) {
            const float *v = x + (r0 + r) * k + b * BLOCK;
            vec s = vmul(w[0], vload(v));
            for (int j = 1; j < NV; j++) s = vfma(w[j], vload(v + LANES * j), s);
            acc[r] = vfma(s, scale, acc[r]);
            if (q4) shift[r] += m * xs[(r0 + r) * nb + b];
        }
    }
    for (int r = 0; r < nr; r++) out[r] = vhsum(acc[r]) + shift[r];
}

static void matmul(const float *x, int64_t rows, int64_t k, const q4_block *q4, const q8_block *q8, int64_t n,
                   float *y, float *xs, int threads) {
    int64_t nb = k / BLOCK;
    if (q4) block_sums(x, rows, k, xs);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
            int nr = rows - r0 < ROWS ? (int)(rows - r0) : ROWS;
            float out[ROWS];
            const q4_block *w4 = q4 ? q4 + i * nb : 0;
            const q8_block *w8 = q8 ? q8 + i * nb : 0;
            if (nr == 1 && w4) dot_rows(x, xs, k, r0, 1, w4, 0, out);  /* specialised: one decode row */
            else if (nr == 1) dot_rows(x, xs, k, r0, 1, 0, w8, out);
            else dot_rows(x, xs, k, r0, nr, w4, w8, out);
            for (int r = 0; r < nr; r++) y[(r0 + r) * n + i] = out[r];
        }
    }
}

/* xs: rows * k / 32 floats of scratch. */
void q4_matmul(const float *x, int64_t rows, int64_t k, const q4_block *w, int64_t n, float *y, float *xs,
               int threads) {
    matmul(x, rows, k, w, 0, n, y, xs, threads);
}

void q8_matmul(const float *x, int64_t rows, int64_t k, const q8_block *w, int64_t n, float *y, int threads) {
    matmul(x, rows, k, 0, w, n, y, 0, threads);
}

/* The float32 values [n, k] of n rows of blocks, as the dense path holds them (Q4: d q + m, two
   roundings; Q8: d q): for prompt chunks, which a dense GEMM serves better. */
void q4_dequantize(const q4_block *w, int64_t n, int64_t k, float *out, int threads) {
    int64_t nb = k / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n * nb; i++) {
        float *o = out + i * BLOCK;
        vec v[NV];
        unpack_q4(w[i].qs, v);
        for (int j = 0; j < NV; j++) vstore(o + LANES * j, vadd(vmul(v[j], vset1(w[i].d)), vset1(w[i].m)));
    }
}

void q8_dequantize(const q8_block *w, int64_t n, int64_t k, float *out, int threads) {
    int64_t nb = k / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n * nb; i++)
        for (int j = 0; j < BLOCK; j++) out[i * BLOCK + j] = w[i].d * (float)w[i].q[j];
}
#endif  /* BLOCKS_SIMD */
