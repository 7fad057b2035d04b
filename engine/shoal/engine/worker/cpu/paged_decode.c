// Paged decode attention for CPUs: one query token per row, K and V read straight from the
// cache blocks named by the row's block table (no gather into a padded copy), a block of tokens at
// a time with an online softmax. Built by shoal/engine/worker/cpu_kernel.py with the machine's C
// compiler on first use (plain C, no torch headers: compiles in about a second) and called
// through ctypes, which releases the GIL for the call. The rows are split across `threads`
// threads of torch's own OpenMP team (see paged_decode at the end).
//
// Layouts (all contiguous, row-major):
//   q, out          [R, Hq, D]        float32 or bfloat16 (is_bf16)
//   k_cache, v_cache [NB, BS, Hkv, D]  same dtype
//   table           [R, W] int64      block ids; only the first ceil(ctx[r] / BS) are read
//   ctx             [R] int64         tokens of context of row r (including the new one)
//   sinks           [Hq] float32 or NULL
// Query heads h * G .. h * G + G - 1 share KV head h (G = Hq / Hkv), as in transformers' GQA.
// Scores and sums are float32 whatever the storage dtype. Returns 0, or -1 for shapes it does
// not handle (the caller then uses the torch path).
//
// The attention variants transformers' models ask for, with transformers' semantics:
//   window > 0   sliding window: a row sees only its last `window` keys (itself included);
//                blocks wholly before the window are not read.
//   softcap > 0  logit soft-capping (Gemma-2): score = softcap * tanh(score / softcap).
//   sinks        attention sinks (gpt-oss): one extra logit per query head that joins the
//                softmax's denominator and has no value.
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "bf16.h"

// Keep in step with MAX_HEAD_DIM, MAX_BLOCK_SIZE, MAX_GROUP in cpu_kernel.py.
#define MAXD 256
#define MAXG 16
#define MAXBS 64


// Sixteen floats as one value (GCC/Clang vector extensions): one AVX-512 register where the CPU
// has AVX-512 (-march=native), two AVX registers on AVX2, split further elsewhere. bf16 loads
// widen sixteen values at once (zero-extend, shift: exact).
typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
static inline vf16 ldf16(const float *p) { vf16 v; memcpy(&v, p, sizeof v); return v; }
static inline void stf16(float *p, vf16 v) { memcpy(p, &v, sizeof v); }
// The storage the main path reads: float32, bf16 widened sixteen at a time (head sizes that are
// a multiple of 16 but not of 32), or bf16 read as pairs (the pair-split layout, see `slot`).
enum { F32 = 0, BF16 = 1, BF16_PAIRS = 2 };

// Sixteen floats of a cache row: dims [d, d + 16) of the row at element `off` (F32, BF16), or
// for BF16_PAIRS the 16-float half at slot d of the row's pair-split layout.
static inline vf16 ld16(const void *base, int mode, int64_t off, int64_t d) {
    if (mode == F32) return ldf16((const float *)base + off + d);
    if (mode == BF16) {
        vh16 h; memcpy(&h, (const uint16_t *)base + off + d, sizeof h);
        vu16 u = __builtin_convertvector(h, vu16) << 16;
        vf16 f; memcpy(&f, &u, sizeof f); return f;
    }
    vu16 w; memcpy(&w, (const uint16_t *)base + off + (d & ~31), sizeof w);
    w = (d & 16) ? (w & 0xFFFF0000u) : (w << 16);  // odd dims : even dims
    vf16 f; memcpy(&f, &w, sizeof f); return f;
}
// Lane permutations: clang spells them __builtin_shufflevector, GCC (any version) __builtin_shuffle.
typedef int32_t vi16 __attribute__((vector_size(64)));
#ifdef __clang__
#define SWZ(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SWZ(v, ...) __builtin_shuffle(v, (vi16){__VA_ARGS__})
#endif
// The sum of the sixteen lanes, in registers (four swaps and adds; splitting the vector through
// memory cost a store-to-load stall per call, and hsum ran once per token and query head).
static inline float hsum16(vf16 v) {
    v += SWZ(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SWZ(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SWZ(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SWZ(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

// exp for x <= 0 (Cephes' expf: Cody-Waite reduction, degree-5 polynomial, ~1 ulp), written
// without calls or branches so the compiler vectorises the loops that use it; libm's expf stays
// scalar and cost most of a block.
static inline float exp_le0(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

static inline void load_rows(const void *cache, int is_bf16, int64_t base, int64_t stride,
                             int64_t cnt, int64_t D, float dst[][MAXD]) {
    for (int64_t t = 0; t < cnt; t++) {
        int64_t off = base + t * stride;
        if (is_bf16) {
            const uint16_t *p = (const uint16_t *)cache + off;
            for (int64_t d = 0; d < D; d++) dst[t][d] = bf16_to_f32(p[d]);
        } else {
            memcpy(dst[t], (const float *)cache + off, D * sizeof(float));
        }
    }
}

// Where dim d of a head sits in qf / acc: d itself, or in the pair-split layout (split = 1) of
// the bf16 main path, which reads 32 bf16 dims as 16 32-bit words and widens the even dims
// (low halves) and the odd dims (high halves) into two float vectors with one op each: within
// every 32 dims, the even ones come first, then the odd ones.
static inline int64_t slot(int64_t d, int split) {
    return split ? (d & ~31) + ((d & 31) >> 1) + ((d & 1) << 4) : d;
}

// A row's `count` query heads from element `off` of q: scaled into qf, their accumulators, running
// maxima and sums reset (finite: no inf arithmetic anywhere).
static inline void start_heads(const void *q, int is_bf16, int64_t off, int64_t count, int64_t D,
                               float scale, float qf[][MAXD], float acc[][MAXD], float *m,
                               float *l, int split) {
    for (int64_t i = 0; i < count; i++) {
        for (int64_t d = 0; d < D; d++) {
            qf[i][slot(d, split)] = (is_bf16 ? bf16_to_f32(((const uint16_t *)q)[off + i * D + d])
                                             : ((const float *)q)[off + i * D + d]) * scale;
            acc[i][d] = 0.f;
        }
        m[i] = -3.0e38f; l[i] = 0.f;
    }
}

// Those heads' outputs (from element `off` of out): acc / l, with each head's sink logit (sinks
// points at the first of them, or is NULL) joining the denominator only.
static inline void finish_heads(void *out, int is_bf16, int64_t off, int64_t count, int64_t D,
                                const float *sinks, float acc[][MAXD], float *m, float *l,
                                int split) {
    for (int64_t i = 0; i < count; i++) {
        float c = 1.f;
        if (sinks) {
            float sv = sinks[i], nm = sv > m[i] ? sv : m[i];
            c = exp_le0(m[i] - nm);
            l[i] = l[i] * c + exp_le0(sv - nm);
        }
        float inv = l[i] > 0.f ? c / l[i] : 0.f;
        for (int64_t d = 0; d < D; d++) {
            float o = acc[i][slot(d, split)] * inv;
            if (is_bf16) ((uint16_t *)out)[off + i * D + d] = f32_to_bf16(o);
            else ((float *)out)[off + i * D + d] = o;
        }
    }
}

// ----- the main path: every KV head of a block at once, sixteen dims at a time ------------------
// A block's K (and V) rows of all KV heads lie contiguously ([BS, Hkv, D]): walking them in that
// order streams each block once, where a head at a time strides through it Hkv times. The next
// block is prefetched while this one is computed: blocks lie anywhere in the cache, so the
// hardware prefetcher cannot guess them. The G query heads of a KV head are taken in runs of
// 8, 4, 2 and 1 whose partial sums stay in registers, each K/V vector widened once per run.
// Used when D is a multiple of 16 and Hq <= MAXH; the per-head path below takes the rest.
#define MAXH 64

static void prefetch_block(const void *kc, const void *vc, int64_t block, int64_t bytes) {
    const char *k = (const char *)kc + block * bytes, *v = (const char *)vc + block * bytes;
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(k + b);
        __builtin_prefetch(v + b);
    }
}

// The prefetch cursor: (row, block) of the walk PREFETCH_AHEAD blocks ahead of the one being
// computed. Blocks lie anywhere in the cache, so the hardware prefetcher cannot follow a row;
// with one block ahead the small model's call took 2.4-2.7 ms (200 rows, 192 tokens, two
// threads), with four 2.0-2.2 ms (2026-12-01, AVX-512 EPYC).
#define PREFETCH_AHEAD 4
struct ahead { int64_t r, j; };

static inline int64_t first_block(const int64_t *ctx, int64_t r, int64_t BS, int64_t window) {
    int64_t n = ctx[r];
    return (window > 0 && n > window ? n - window : 0) / BS;
}

static inline void ahead_next(struct ahead *a, const int64_t *ctx, int64_t R, int64_t BS,
                              int64_t window) {
    if (a->r >= R) return;
    if (++a->j * BS >= ctx[a->r] && ++a->r < R) a->j = first_block(ctx, a->r, BS, window);
}

// Scores of one block's cnt tokens for query heads hq0 .. hq0 + n - 1 (all on KV head h):
// s[hq][t] = q[hq] . k[t], soft-capped. n is a constant at each call site (8, 4, 2 or 1), so
// the n partial sums live in registers.
static inline __attribute__((always_inline)) void scores_n(
        const void *kc, int mode, int64_t base, int64_t cnt, int64_t Hkv, int64_t D,
        int64_t h, int64_t hq0, int64_t n, float qf[][MAXD], float softcap, float s[][MAXBS]) {
    for (int64_t t = 0; t < cnt; t++) {
        int64_t off = base + (t * Hkv + h) * D;
        vf16 a[8];
        for (int64_t i = 0; i < n; i++) a[i] = (vf16){0};
        for (int64_t d = 0; d < D; d += 16) {
            vf16 k = ld16(kc, mode, off, d);
            for (int64_t i = 0; i < n; i++) a[i] += ldf16(qf[hq0 + i] + d) * k;
        }
        for (int64_t i = 0; i < n; i++) {
            float x = hsum16(a[i]);
            if (softcap > 0.f) x = softcap * tanhf(x / softcap);
            s[hq0 + i][t] = x;
        }
    }
}

// acc[hq] = acc[hq] * c[hq] + sum_t p[hq][t] * v[t] over one block, for the same n heads; two
// accumulators per head (even and odd tokens) so the adds do not wait on each other.
static inline __attribute__((always_inline)) void values_n(
        const void *vc, int mode, int64_t base, int64_t cnt, int64_t Hkv, int64_t D,
        int64_t h, int64_t hq0, int64_t n, float s[][MAXBS], const float *c,
        float acc[][MAXD]) {
    for (int64_t d = 0; d < D; d += 16) {
        vf16 a[8], b[8];
        for (int64_t i = 0; i < n; i++) {
            a[i] = ldf16(acc[hq0 + i] + d) * c[hq0 + i];
            b[i] = (vf16){0};
        }
        int64_t t = 0;
        for (; t + 1 < cnt; t += 2) {
            vf16 v0 = ld16(vc, mode, base + (t * Hkv + h) * D, d);
            vf16 v1 = ld16(vc, mode, base + ((t + 1) * Hkv + h) * D, d);
            for (int64_t i = 0; i < n; i++) {
                a[i] += s[hq0 + i][t] * v0;
                b[i] += s[hq0 + i][t + 1] * v1;
            }
        }
        if (t < cnt) {
            vf16 v0 = ld16(vc, mode, base + (t * Hkv + h) * D, d);
            for (int64_t i = 0; i < n; i++) a[i] += s[hq0 + i][t] * v0;
        }
        for (int64_t i = 0; i < n; i++) stf16(acc[hq0 + i] + d, a[i] + b[i]);
    }
}

// A KV head's G query heads in runs of 8, 4, 2 and 1 (each run's sums in registers).
#define BY_RUNS(CALL)                                                     \
    for (int64_t h = 0; h < Hkv; h++)                                     \
        for (int64_t g0 = 0; g0 < G;) {                                   \
            int64_t left = G - g0, hq0 = h * G + g0;                      \
            if (left >= 8) { CALL(8); g0 += 8; }                          \
            else if (left >= 4) { CALL(4); g0 += 4; }                     \
            else if (left >= 2) { CALL(2); g0 += 2; }                     \
            else { CALL(1); g0 += 1; }                                    \
        }
#define SCORES(N) scores_n(kc, mode, base, cnt, Hkv, D, h, hq0, N, qf, softcap, s)
#define VALUES(N) values_n(vc, mode, base, cnt, Hkv, D, h, hq0, N, s, c, acc)

static inline __attribute__((always_inline)) void walk(
        const void *q, const void *kc, const void *vc, const int64_t *table, const int64_t *ctx,
        void *out, int64_t R, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t W,
        int64_t window, float scale, float softcap, const float *sinks, int mode) {
    int is_bf16 = mode != F32, split = mode == BF16_PAIRS;
    int64_t G = Hq / Hkv, block_bytes = BS * Hkv * D * (is_bf16 ? 2 : 4);
    // On the stack (144 KiB at most): a static __thread array in a shared library is reached
    // through __tls_get_addr, which the compiler called inside the loops.
    float qf[MAXH][MAXD], acc[MAXH][MAXD], s[MAXH][MAXBS];
    float m[MAXH], l[MAXH], c[MAXH];
    if (R <= 0) return;  // no row: not even ctx[0] to read
    struct ahead ahead = {0, first_block(ctx, 0, BS, window)};
    for (int64_t i = 0; i < PREFETCH_AHEAD && ahead.r < R; i++) {
        prefetch_block(kc, vc, table[ahead.r * W + ahead.j], block_bytes);
        if (i + 1 < PREFETCH_AHEAD) ahead_next(&ahead, ctx, R, BS, window);
    }
    for (int64_t r = 0; r < R; r++) {
        int64_t n = ctx[r];
        int64_t first = window > 0 && n > window ? n - window : 0;  // first key the row sees
        start_heads(q, is_bf16, r * Hq * D, Hq, D, scale, qf, acc, m, l, split);
        for (int64_t j = first / BS; j * BS < n; j++) {
            int64_t lo = j * BS > first ? j * BS : first;
            int64_t hi = (j + 1) * BS < n ? (j + 1) * BS : n, cnt = hi - lo;
            int64_t base = (table[r * W + j] * BS + (lo - j * BS)) * Hkv * D;
            // The block PREFETCH_AHEAD blocks further on in this walk (this row's, or the next
            // rows' first ones).
            ahead_next(&ahead, ctx, R, BS, window);
            if (ahead.r < R) prefetch_block(kc, vc, table[ahead.r * W + ahead.j], block_bytes);
            BY_RUNS(SCORES)
            for (int64_t hq = 0; hq < Hq; hq++) {  // online softmax, block by block
                float bm = -3.0e38f;
                for (int64_t t = 0; t < cnt; t++) bm = s[hq][t] > bm ? s[hq][t] : bm;
                float nm = bm > m[hq] ? bm : m[hq], sum = 0.f;
                c[hq] = exp_le0(m[hq] - nm);
                for (int64_t t = 0; t < cnt; t++) {
                    s[hq][t] = exp_le0(s[hq][t] - nm);
                    sum += s[hq][t];
                }
                l[hq] = l[hq] * c[hq] + sum;
                m[hq] = nm;
            }
            BY_RUNS(VALUES)
        }
        finish_heads(out, is_bf16, r * Hq * D, Hq, D, sinks, acc, m, l, split);
    }
}

static void decode_blockwise(const void *q, const void *kc, const void *vc, const int64_t *table,
                             const int64_t *ctx, void *out, int64_t R, int64_t Hq, int64_t Hkv,
                             int64_t D, int64_t BS, int64_t W, int64_t window, float scale,
                             float softcap, const float *sinks, int is_bf16) {
    // One copy of the walk per storage mode: no dtype test in the inner loops.
    if (!is_bf16)
        walk(q, kc, vc, table, ctx, out, R, Hq, Hkv, D, BS, W, window, scale, softcap, sinks, F32);
    else if (D % 32 == 0)
        walk(q, kc, vc, table, ctx, out, R, Hq, Hkv, D, BS, W, window, scale, softcap, sinks,
             BF16_PAIRS);
    else
        walk(q, kc, vc, table, ctx, out, R, Hq, Hkv, D, BS, W, window, scale, softcap, sinks,
             BF16);
}

// ----- one thread's rows: the dispatch, and below it the per-head path (more than MAXH query ----
// heads, or a head size that is not a multiple of 16)
static void decode_rows(const void *q, const void *kc, const void *vc, const int64_t *table,
                        const int64_t *ctx, void *out, int64_t R, int64_t Hq, int64_t Hkv,
                        int64_t D, int64_t BS, int64_t W, int64_t window, float scale,
                        float softcap, const float *sinks, int is_bf16) {
    if (Hq <= MAXH && D % 16 == 0) {
        decode_blockwise(q, kc, vc, table, ctx, out, R, Hq, Hkv, D, BS, W, window, scale,
                         softcap, sinks, is_bf16);
        return;
    }
    int64_t G = Hq / Hkv;
    float qf[MAXG][MAXD], acc[MAXG][MAXD], m[MAXG], l[MAXG];
    float kf[MAXBS][MAXD], vf[MAXBS][MAXD], s[MAXBS];
    for (int64_t r = 0; r < R; r++) {
        int64_t n = ctx[r];
        int64_t first = window > 0 && n > window ? n - window : 0;  // first key the row sees
        for (int64_t h = 0; h < Hkv; h++) {
            start_heads(q, is_bf16, (r * Hq + h * G) * D, G, D, scale, qf, acc, m, l, 0);
            for (int64_t j = first / BS; j * BS < n; j++) {
                int64_t lo = j * BS > first ? j * BS : first;
                int64_t hi = (j + 1) * BS < n ? (j + 1) * BS : n, cnt = hi - lo;
                int64_t base = ((table[r * W + j] * BS + (lo - j * BS)) * Hkv + h) * D;
                load_rows(kc, is_bf16, base, Hkv * D, cnt, D, kf);
                load_rows(vc, is_bf16, base, Hkv * D, cnt, D, vf);
                for (int64_t g = 0; g < G; g++) {
                    float bm = -3.0e38f;
                    for (int64_t t = 0; t < cnt; t++) {
                        float x = 0.f;
                        for (int64_t d = 0; d < D; d++) x += qf[g][d] * kf[t][d];
                        if (softcap > 0.f) x = softcap * tanhf(x / softcap);
                        s[t] = x;
                        bm = x > bm ? x : bm;
                    }
                    float nm = bm > m[g] ? bm : m[g];
                    float c = exp_le0(m[g] - nm);
                    float sum = 0.f;
                    for (int64_t t = 0; t < cnt; t++) { s[t] = exp_le0(s[t] - nm); sum += s[t]; }
                    l[g] = l[g] * c + sum;
                    for (int64_t d = 0; d < D; d++) acc[g][d] *= c;
                    for (int64_t t = 0; t < cnt; t++) {
                        float p = s[t];
                        for (int64_t d = 0; d < D; d++) acc[g][d] += p * vf[t][d];
                    }
                    m[g] = nm;
                }
            }
            finish_heads(out, is_bf16, (r * Hq + h * G) * D, G, D, sinks ? sinks + h * G : NULL,
                         acc, m, l, 0);
        }
    }
}

// The work of a row: the keys it reads, plus a block's worth for its fixed cost (its queries,
// its output, the first block's miss).
static inline int64_t row_work(const int64_t *ctx, int64_t r, int64_t BS, int64_t window) {
    int64_t n = ctx[r];
    return (window > 0 && n > window ? window : n) + BS;
}

// The first row of part `part` of `parts`: rows split into contiguous ranges of about equal work,
// since a batch mixes short and long contexts.
static int64_t split_row(const int64_t *ctx, int64_t R, int64_t BS, int64_t window, int part,
                         int parts) {
    if (part <= 0) return 0;
    if (part >= parts) return R;
    int64_t total = 0, sum = 0, r = 0;
    for (int64_t i = 0; i < R; i++) total += row_work(ctx, i, BS, window);
    int64_t goal = total * part / parts;
    while (r < R && sum < goal) sum += row_work(ctx, r++, BS, window);
    return r;
}

// ----- the entry point ------------------------------------------------------------------------
// threads: how many threads of the calling thread's OpenMP team take a contiguous range of rows
// each. This library is linked with -fopenmp against libgomp.so.1, and torch has loaded its own
// libgomp.so.1 before the engine loads it, so the dynamic loader binds it to torch's copy: the
// ranges run on the very threads torch's ops run on, which spin briefly between ops, not on a
// second pool competing with them for the cores.
int paged_decode(const void *q, const void *kc, const void *vc, const int64_t *table,
                 const int64_t *ctx, void *out, int64_t R, int64_t Hq, int64_t Hkv, int64_t D,
                 int64_t BS, int64_t W, int64_t window, float scale, float softcap,
                 const float *sinks, int is_bf16, int threads) {
    if (D > MAXD || BS > MAXBS || Hq % Hkv || Hq / Hkv > MAXG) return -1;
    if (threads > R) threads = (int)R;
    if (threads < 1) threads = 1;
    const int64_t row_bytes = Hq * D * (is_bf16 ? 2 : 4);
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int parts = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t a = split_row(ctx, R, BS, window, t, parts);
        int64_t b = split_row(ctx, R, BS, window, t + 1, parts);
        if (b > a)
            decode_rows((const char *)q + a * row_bytes, kc, vc, table + a * W, ctx + a,
                        (char *)out + a * row_bytes, b - a, Hq, Hkv, D, BS, W, window, scale,
                        softcap, sinks, is_bf16);
    }
    return 0;
}
