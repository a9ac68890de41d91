/* A GGUF's Q4_0 / Q4_1 / Q8_0 weights multiplied as they are stored, in float32 (models/cpu_blocks.py).

   A block is 32 weights along the input: Q4 w = d * q + m (q in 0..15; Q4_0's m is -8 d), Q8_0
   w = d * q (q in -127..127). Each block's weights are made their float32 values once, as the dense
   path holds them (Q4 fma(q, d, m): d is a float16 value and q has 4 bits, so d q is exact and the
   one rounding is the dense path's d q + m), and each row multiplies those by its float32 inputs:
   the dense path's products, summed in another order. A row costs 4 loads and 4 multiply-adds
   a block (8 lanes), the unpacking is shared by the rows in the call, and a row's sums are the
   same bit for bit whichever rows share it (a verify step's logits are the decode step's).

   Layout (the caller's tensors, all contiguous): x [rows, k] float32, y [rows, n] float32, and
   the weight as n rows of k / 32 blocks, each block one record (a decode step streams them once, in
   order, prefetching ahead): Q4 {float d, m; 16 bytes, weight j < 16 byte j's low nibble, weight
   16 + j its high nibble (GGUF's order)}, Q8 {float d; 32 int8}. k is a multiple of 32. Rows go up
   to 8 at a time through each block (a verify step of k + 1 <= 8 rows unpacks each block once);
   outputs are split over `threads` OpenMP threads. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BLOCKS_SIMD 1
#endif

#define BLOCK 32
#define ROWS 8  /* rows a pass over a weight block serves: a verify step of up to 8 at once */
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
/* Seconds the calling thread waited at the ends of its parallel loops for the others (a helper
   that another process holds off its core shows here); blocks_held_up reads and clears it. */
static double held_up;

double blocks_held_up(void) {
    double s = held_up;
    held_up = 0.0;
    return s;
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
#define vsub _mm512_sub_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vdiv _mm512_div_ps
#define vfloor(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define vpow2i(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23))

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
#define vsub _mm256_sub_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vdiv _mm256_div_ps
#define vfloor _mm256_floor_ps
#define vpow2i(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23))

static inline float vhsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Each 8 bytes widened to 32-bit lanes straight from memory, then their low and high nibbles. */
static inline void unpack_q4(const uint8_t *q, vec w[NV]) {
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    __m256i low = _mm256_set1_epi32(0x0F);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

static inline void unpack_q8(const int8_t *q, vec w[NV]) {
    for (int i = 0; i < NV; i++)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
}
#endif

/* y[r][i] for rows r0 .. r0 + NR - 1 (NR <= ROWS, a constant in each copy) of one output's blocks
   (q4 or q8). Each block's weights are made the dense path's float32 values once (Q4 fma(q, d, m),
   Q8 d q), then each row sums its 32 products in one chain of lane-wide multiply-adds, added to
   its accumulator a block: the same arithmetic whichever rows share the call. */
static inline __attribute__((always_inline)) void dot_rows(const float *x, int64_t k,
                                                           int64_t r0, const int NR, const q4_block *q4,
                                                           const q8_block *q8, float *out) {
    int64_t nb = k / BLOCK;
    vec acc[ROWS];
    for (int r = 0; r < NR; r++) acc[r] = vzero();
    for (int64_t b = 0; b < nb; b++) {
        vec w[NV];
        if (q4) {
            __builtin_prefetch((const char *)(q4 + b) + PREFETCH);
            unpack_q4(q4[b].qs, w);
            vec d = vset1(q4[b].d), m = vset1(q4[b].m);
            for (int j = 0; j < NV; j++) w[j] = vfma(w[j], d, m);  /* = fl(fl(d q) + m): d q is exact */
        } else {
            __builtin_prefetch((const char *)(q8 + b) + PREFETCH);
            unpack_q8(q8[b].q, w);
            vec d = vset1(q8[b].d);
            for (int j = 0; j < NV; j++) w[j] = vmul(w[j], d);
        }
        for (int r = 0; r < NR; r++) {
            const float *v = x + (r0 + r) * k + b * BLOCK;
            vec s = vmul(w[0], vload(v));
            for (int j = 1; j < NV; j++) s = vfma(w[j], vload(v + LANES * j), s);
            acc[r] = vadd(acc[r], s);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = vhsum(acc[r]);
}

/* One copy a row count and type (each unrolled over its rows, with its own registers). */
typedef void (*dot_fn)(const float *, int64_t, int64_t, const q4_block *, const q8_block *, float *);
#define DOT_COPIES(c) \
    static __attribute__((noinline)) void dot_q4_##c(const float *x, int64_t k, int64_t r0, \
                                                     const q4_block *q4, const q8_block *q8, float *out) { \
        (void)q8; \
        dot_rows(x, k, r0, c, q4, 0, out); \
    } \
    static __attribute__((noinline)) void dot_q8_##c(const float *x, int64_t k, int64_t r0, \
                                                     const q4_block *q4, const q8_block *q8, float *out) { \
        (void)q4; \
        dot_rows(x, k, r0, c, 0, q8, out); \
    }
DOT_COPIES(1) DOT_COPIES(2) DOT_COPIES(3) DOT_COPIES(4) DOT_COPIES(5) DOT_COPIES(6) DOT_COPIES(7) DOT_COPIES(8)
#undef DOT_COPIES
static const dot_fn dot_q4[ROWS + 1] = {0, dot_q4_1, dot_q4_2, dot_q4_3, dot_q4_4, dot_q4_5, dot_q4_6, dot_q4_7, dot_q4_8};
static const dot_fn dot_q8[ROWS + 1] = {0, dot_q8_1, dot_q8_2, dot_q8_3, dot_q8_4, dot_q8_5, dot_q8_6, dot_q8_7, dot_q8_8};

static void matmul(const float *x, int64_t rows, int64_t k, const q4_block *q4, const q8_block *q8, int64_t n,
                   float *y, int threads) {
    int64_t nb = k / BLOCK;
    double done = 0.0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < n; i++) {
            for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
                int nr = rows - r0 < ROWS ? (int)(rows - r0) : ROWS;
                float out[ROWS];
                if (q4) dot_q4[nr](x, k, r0, q4 + i * nb, 0, out);
                else dot_q8[nr](x, k, r0, 0, q8 + i * nb, out);
                for (int r = 0; r < nr; r++) y[(r0 + r) * n + i] = out[r];
            }
        }
        if (omp_get_thread_num() == 0) done = omp_get_wtime();
    }
    if (threads > 1) held_up += omp_get_wtime() - done;
}

void q4_matmul(const float *x, int64_t rows, int64_t k, const q4_block *w, int64_t n, float *y, int threads) {
    matmul(x, rows, k, w, 0, n, y, threads);
}

void q8_matmul(const float *x, int64_t rows, int64_t k, const q8_block *w, int64_t n, float *y, int threads) {
    matmul(x, rows, k, 0, w, n, y, threads);
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

/* ---- One decode step of a Llama stack whose every linear is Q4 blocks (BlockDecoder) ----------

   The layers' step as models/layers.py runs it on the CPU, in one call: per layer, RMSNorm, the
   q/k/v blocks, rope on q and k (x cos + roll(x, half) [-sin | sin], as Rope.turn_), K and V
   written to the token's (block, offset) of its table, each query head over the token's cached
   positions (softmax in float32, exactly, not online), the o blocks and the residual add, RMSNorm,
   the gate/up blocks, silu(gate) up, the down blocks and the residual add. float32 throughout. */

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps, scale;  /* RMSNorm's epsilon; attention's head_dim ** -0.5 */
    const int64_t *weights; /* [layers][6]: the qkv, o, gate_up, down blocks; norm weights 1 and 2 */
    float *kv;              /* the store [layers][blocks][block_size][2 kv_heads][head_dim] */
    int64_t kv_layer;       /* floats per layer of kv */
    const int32_t *table;   /* [slots][table_width] each slot's block ids */
    int64_t table_width;
    const void *head;       /* the output head's blocks (Q4 when head_q4, else Q8_0), vocab outputs */
    int64_t vocab, head_q4;
    const float *norm;      /* the final RMSNorm's weight */
} llama_stack;

/* e^x, Cephes' single-precision range reduction and polynomial (about 1 ulp over the softmax's
   and silu's arguments; the clamp keeps 2^n a normal float). */
static inline vec vexp(vec x) {
    x = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
    vec n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
    vec r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vec p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
    return vmul(p, vpow2i(n));
}

static inline float dot(const float *a, const float *b, int64_t n) {
    vec acc = vmul(vload(a), vload(b));
    for (int64_t i = LANES; i < n; i += LANES) acc = vfma(vload(a + i), vload(b + i), acc);
    return vhsum(acc);
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    vec acc = vzero();
    for (int64_t i = 0; i < n; i += LANES) acc = vfma(vload(x + i), vload(x + i), acc);
    float r = 1.0f / sqrtf(vhsum(acc) / (float)n + eps);
    for (int64_t i = 0; i < n; i += LANES) vstore(out + i, vmul(vmul(vload(x + i), vset1(r)), vload(w + i)));
}

static void add_into(float *h, const float *d, int64_t n) {
    for (int64_t i = 0; i < n; i += LANES) vstore(h + i, vadd(vload(h + i), vload(d + i)));
}

/* x [heads][dim] turned in place by one position's cos / sin [dim]. */
static void rope(float *x, int64_t heads, int64_t dim, const float *cos, const float *sin) {
    int64_t half = dim / 2;
    float t[512];
    for (int64_t h = 0; h < heads; h++, x += dim) {
        for (int64_t i = 0; i < half; i++) {
            t[i] = x[i] * cos[i] + x[i + half] * -sin[i];
            t[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
        }
        for (int64_t i = 0; i < dim; i++) x[i] = t[i];
    }
}

/* The cached positions of a sequence in order, block by block (no division a position). */
typedef struct {
    const float *kvl;
    const int32_t *tab;
    int64_t bs, row, blk, off;
} walk;

static inline const float *next_position(walk *w) {
    const float *at = w->kvl + ((int64_t)w->tab[w->blk] * w->bs + w->off) * w->row;
    if (++w->off == w->bs) w->off = 0, w->blk++;
    return at;
}

/* The scores e [ctx] of query head qj over KV head g's keys: in the row's 8-position tiles from 0,
   each tile's 8 dots at once (8 chains of FMAs, one reduction), then the rest one by one. */
static void tile_scores(const llama_stack *s, const float *qj, const float *const k[8], float *e) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_mul_ps(_mm256_loadu_ps(qj), _mm256_loadu_ps(k[i]));
    for (int64_t d = 8; d < s->head_dim; d += 8) {
        __m256 qd = _mm256_loadu_ps(qj + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[i] + d), a[i]);
    }
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(e, _mm256_mul_ps(sum, _mm256_set1_ps(s->scale)));
}

/* e [ctx] made e^(x - max) in place; their sum (lane by lane, then the lanes). */
static float softmax_weights(float *e, int64_t ctx) {
    int64_t full = ctx / LANES * LANES, p;
    float top = e[0], total;
    if (full) {
        vec m = vload(e);
        for (p = LANES; p < full; p += LANES) m = vmax(m, vload(e + p));
        float lanes[LANES];
        vstore(lanes, m);
        for (int i = 0; i < LANES; i++) top = lanes[i] > top ? lanes[i] : top;
    }
    for (p = full; p < ctx; p++) top = e[p] > top ? e[p] : top;
    vec sums = vzero();
    for (p = 0; p < full; p += LANES) {
        vec x = vexp(vadd(vload(e + p), vset1(-top)));
        vstore(e + p, x);
        sums = vadd(sums, x);
    }
    total = vhsum(sums);
    if (p < ctx) {
        float tail[LANES] = {0};
        for (int64_t i = p; i < ctx; i++) tail[i - p] = e[i] - top;
        vstore(tail, vexp(vload(tail)));
        for (int64_t i = p; i < ctx; i++) total += (e[i] = tail[i - p]);
    }
    return total;
}

#define TILE 16  /* positions whose values a run's rows take in turn while they are in L1 */

/* Query head h of `nr` rows of one sequence (block ids `tab`; row r sees positions 0 .. pos[r], its
   query at q + r * q_stride, its output at out + r * o_stride, its scores at e[r]) in layer `kvl`.
   The rows take each tile of keys and values in turn while it is cached; a row's arithmetic is
   the same whichever rows share the call (one row alone keeps its sums in registers). */
static void attend_run(const llama_stack *s, const float *kvl, const int32_t *tab, const int64_t *pos, int nr,
                       const float *q, int64_t q_stride, int64_t h, float *out, int64_t o_stride, float *const *e) {
    int64_t dim = s->head_dim, g = h / (s->heads / s->kv_heads), bs = s->block_size, ctx[ROWS], most = 0;
    const walk start = {kvl, tab, bs, 2 * s->kv_heads * dim, 0, 0};
    for (int r = 0; r < nr; r++) ctx[r] = pos[r] + 1, most = ctx[r] > most ? ctx[r] : most;
    walk w = start;
    for (int64_t p = 0; p + 8 <= most; p += 8) {
        const float *k[8];
        for (int i = 0; i < 8; i++) k[i] = next_position(&w) + g * dim;
        for (int r = 0; r < nr; r++)
            if (p + 8 <= ctx[r]) tile_scores(s, q + r * q_stride + h * dim, k, e[r] + p);
    }
    float total[ROWS];
    for (int r = 0; r < nr; r++) {
        for (int64_t p = ctx[r] / 8 * 8; p < ctx[r]; p++) {
            const float *k = kvl + ((int64_t)tab[p / bs] * bs + p % bs) * start.row + g * dim;
            e[r][p] = dot(q + r * q_stride + h * dim, k, dim) * s->scale;
        }
        total[r] = softmax_weights(e[r], ctx[r]);
    }
    /* sum_p e_p v_p, 8 vectors of the head at a time, in order of p */
    int64_t vo = (s->kv_heads + g) * dim;
    for (int64_t c = 0; c < dim; c += 8 * LANES) {
        int n = dim - c < 8 * LANES ? (int)((dim - c) / LANES) : 8;
        if (nr == 1 && n == 8) {  /* one row: its sums held in registers over every position */
            vec acc[8];
            for (int i = 0; i < 8; i++) acc[i] = vzero();
            w = start;
            for (int64_t p = 0; p < ctx[0]; p++) {
                const float *v = next_position(&w) + vo + c;
                vec weight = vset1(e[0][p]);
                for (int i = 0; i < 8; i++) acc[i] = vfma(weight, vload(v + LANES * i), acc[i]);
            }
            for (int i = 0; i < 8; i++) vstore(out + c + LANES * i, vdiv(acc[i], vset1(total[0])));
            continue;
        }
        vec sums[ROWS][8];
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < 8; i++) sums[r][i] = vzero();
        w = start;
        for (int64_t p0 = 0; p0 < most; p0 += TILE) {
            const float *v[TILE];
            int64_t end = most - p0 < TILE ? most : p0 + TILE;
            for (int64_t p = p0; p < end; p++) v[p - p0] = next_position(&w) + vo + c;
            for (int r = 0; r < nr; r++) {
                int64_t stop = ctx[r] < end ? ctx[r] : end;
                vec acc[8];
                for (int i = 0; i < 8; i++) acc[i] = sums[r][i];
                for (int64_t p = p0; p < stop; p++) {
                    vec weight = vset1(e[r][p]);
                    for (int i = 0; i < 8; i++)
                        if (i < n) acc[i] = vfma(weight, vload(v[p - p0] + LANES * i), acc[i]);
                }
                for (int i = 0; i < 8; i++) sums[r][i] = acc[i];
            }
        }
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < n; i++) vstore(out + r * o_stride + c + LANES * i, vdiv(sums[r][i], vset1(total[r])));
    }
}

/* Every query head of `rows` decode tokens (row r's heads at q + r * q_stride, out [rows][heads][dim])
   over its sequence's positions 0 .. pos[r] in layer `kvl`; scores: rows * heads * (max pos + 1).
   Consecutive rows of one sequence (a verify step's, up to ROWS) go together, a query head of them a
   work item, split over the threads. */
static void attend_rows(const llama_stack *s, const float *kvl, int64_t rows, const float *q, int64_t q_stride,
                        const int64_t *slot, const int64_t *pos, float *out, float *scores, int threads) {
    int64_t heads = s->heads, dim = s->head_dim, nq = heads * dim, max_ctx = 0, runs = 0;
    int64_t first[rows + 1];
    for (int64_t r = 0; r < rows; r++) {
        max_ctx = pos[r] + 1 > max_ctx ? pos[r] + 1 : max_ctx;
        if (r == 0 || slot[r] != slot[r - 1] || r - first[runs - 1] == ROWS) first[runs++] = r;
    }
    first[runs] = rows;
    double done = 0.0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t it = 0; it < runs * heads; it++) {
            int64_t r0 = first[it / heads], h = it % heads;
            int nr = (int)(first[it / heads + 1] - r0);
            float *e[ROWS];
            for (int r = 0; r < nr; r++) e[r] = scores + ((r0 + r) * heads + h) * max_ctx;
            attend_run(s, kvl, s->table + slot[r0] * s->table_width, pos + r0, nr, q + r0 * q_stride, q_stride, h,
                       out + r0 * nq + h * dim, nq, e);
        }
        if (omp_get_thread_num() == 0) done = omp_get_wtime();
    }
    if (threads > 1) held_up += omp_get_wtime() - done;
}

/* Decode attention for the CPU's torch backend (models/cpu_attention.py) over a float32 store
   layer: the `attend_rows` of a stack holding only the attention's shape. */
void decode_attention(const float *q, int64_t rows, int64_t q_stride, const float *kvl, const int32_t *table,
                      int64_t table_width, const int64_t *slot, const int64_t *pos, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t block_size, float scale, float *out, float *scores, int threads) {
    llama_stack s = {0};
    s.heads = heads, s.kv_heads = kv_heads, s.head_dim = head_dim, s.block_size = block_size, s.scale = scale;
    s.table = table, s.table_width = table_width;
    attend_rows(&s, kvl, rows, q, q_stride, slot, pos, out, scores, threads);
}

/* Floats of `work` llama_decode needs for `rows` tokens seeing at most max_ctx positions. */
int64_t llama_decode_work(const llama_stack *s, int64_t rows, int64_t max_ctx) {
    int64_t nq = s->heads * s->head_dim, qkv = nq + 2 * s->kv_heads * s->head_dim;
    return rows * (2 * s->hidden + qkv + nq + 3 * s->inter + s->heads * max_ctx);
}

/* h [rows][hidden]: the embedded tokens (overwritten: the residual stream); logits [rows][vocab]:
   the head's over the final norm. cos / sin [rows][head_dim]: each token's rotary tables; slot /
   pos [rows]: its sequence's table row and position (it sees 0 .. pos). */
void llama_decode(const llama_stack *s, int64_t rows, float *h, const float *cos, const float *sin,
                  const int64_t *slot, const int64_t *pos, float *work, float *logits, int threads) {
    int64_t hid = s->hidden, dim = s->head_dim, kvh = s->kv_heads, nq = s->heads * dim;
    int64_t nqkv = nq + 2 * kvh * dim, inter = s->inter;
    float *x = work, *delta = x + rows * hid, *qkv = delta + rows * hid, *att = qkv + rows * nqkv;
    float *gu = att + rows * nq, *act = gu + rows * 2 * inter;
    float *scores = act + rows * inter;
    for (int64_t l = 0; l < s->layers; l++) {
        const int64_t *w = s->weights + 6 * l;
        float *kvl = s->kv + l * s->kv_layer;
        for (int64_t r = 0; r < rows; r++) rms_norm(h + r * hid, (const float *)w[4], hid, s->eps, x + r * hid);
        matmul(x, rows, hid, (const q4_block *)w[0], 0, nqkv, qkv, threads);
        for (int64_t r = 0; r < rows; r++) {
            float *t = qkv + r * nqkv;
            rope(t, s->heads + kvh, dim, cos + r * dim, sin + r * dim);
            int64_t blk = s->table[slot[r] * s->table_width + pos[r] / s->block_size];
            float *dst = kvl + (blk * s->block_size + pos[r] % s->block_size) * 2 * kvh * dim;
            for (int64_t i = 0; i < 2 * kvh * dim; i++) dst[i] = t[nq + i];
        }
        attend_rows(s, kvl, rows, qkv, nqkv, slot, pos, att, scores, threads);
        matmul(att, rows, nq, (const q4_block *)w[1], 0, hid, delta, threads);
        for (int64_t r = 0; r < rows; r++) {
            add_into(h + r * hid, delta + r * hid, hid);
            rms_norm(h + r * hid, (const float *)w[5], hid, s->eps, x + r * hid);
        }
        matmul(x, rows, hid, (const q4_block *)w[2], 0, 2 * inter, gu, threads);
        for (int64_t r = 0; r < rows; r++) {
            const float *gate = gu + r * 2 * inter, *up = gate + inter;
            for (int64_t i = 0; i < inter; i += LANES) {
                vec v = vload(gate + i);
                vec silu = vdiv(v, vadd(vset1(1.0f), vexp(vsub(vzero(), v))));
                vstore(act + r * inter + i, vmul(silu, vload(up + i)));
            }
        }
        matmul(act, rows, inter, (const q4_block *)w[3], 0, hid, delta, threads);
        for (int64_t r = 0; r < rows; r++) add_into(h + r * hid, delta + r * hid, hid);
    }
    for (int64_t r = 0; r < rows; r++) rms_norm(h + r * hid, s->norm, hid, s->eps, x + r * hid);
    const q4_block *h4 = s->head_q4 ? (const q4_block *)s->head : 0;
    matmul(x, rows, hid, h4, h4 ? 0 : (const q8_block *)s->head, s->vocab, logits, threads);
}
#endif  /* BLOCKS_SIMD */
