// Paged decode attention for CPUs: one query token per row, K and V read straight from the
// cache blocks named by the row's block table (no gather into a padded copy), a block of tokens at
// a time with an online softmax. Built by shoal/engine/worker/cpu_kernel.py with the machine's C
// compiler on first use (plain C, no torch headers: compiles in about a second) and called
// through ctypes, which releases the GIL for the call.
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
#include <stdint.h>
#include <math.h>
#include <string.h>

// Keep in step with MAX_HEAD_DIM, MAX_BLOCK_SIZE, MAX_GROUP in cpu_kernel.py.
#define MAXD 256
#define MAXG 16
#define MAXBS 64

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
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

int paged_decode(const void *q, const void *kc, const void *vc, const int64_t *table,
                 const int64_t *ctx, void *out, int64_t R, int64_t Hq, int64_t Hkv, int64_t D,
                 int64_t BS, int64_t W, int64_t window, float scale, float softcap,
                 const float *sinks, int is_bf16) {
    if (D > MAXD || BS > MAXBS || Hq % Hkv || Hq / Hkv > MAXG) return -1;
    int64_t G = Hq / Hkv;
    float qf[MAXG][MAXD], acc[MAXG][MAXD], m[MAXG], l[MAXG];
    float kf[MAXBS][MAXD], vf[MAXBS][MAXD], s[MAXBS];
    for (int64_t r = 0; r < R; r++) {
        int64_t n = ctx[r];
        int64_t first = window > 0 && n > window ? n - window : 0;  // first key the row sees
        for (int64_t h = 0; h < Hkv; h++) {
            for (int64_t g = 0; g < G; g++) {
                int64_t qoff = (r * Hq + h * G + g) * D;
                for (int64_t d = 0; d < D; d++) {
                    qf[g][d] = (is_bf16 ? bf16_to_f32(((const uint16_t *)q)[qoff + d])
                                        : ((const float *)q)[qoff + d]) * scale;
                    acc[g][d] = 0.f;
                }
                m[g] = -3.0e38f; l[g] = 0.f;  // finite: no inf arithmetic anywhere
            }
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
            for (int64_t g = 0; g < G; g++) {
                int64_t ooff = (r * Hq + h * G + g) * D;
                float c = 1.f;
                if (sinks) {  // the sink's logit joins the denominator only
                    float sv = sinks[h * G + g], nm = sv > m[g] ? sv : m[g];
                    c = exp_le0(m[g] - nm);
                    l[g] = l[g] * c + exp_le0(sv - nm);
                }
                float inv = l[g] > 0.f ? c / l[g] : 0.f;
                for (int64_t d = 0; d < D; d++) {
                    float o = acc[g][d] * inv;
                    if (is_bf16) ((uint16_t *)out)[ooff + d] = f32_to_bf16(o);
                    else ((float *)out)[ooff + d] = o;
                }
            }
        }
    }
    return 0;
}
