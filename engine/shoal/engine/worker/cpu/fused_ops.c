/* Fused float32 elementwise ops for the CPU (loaded by cpu_fused.py with ctypes).
 *
 * rms_norm_f32: transformers' RMSNorm in one pass per row, where torch runs five kernels
 * (pow, mean, add, rsqrt, two muls), each writing a fresh [tokens, hidden] tensor:
 *     out[r] = (w + w_offset) * (x[r] * 1 / sqrt(mean(x[r]^2) + eps))
 * w_offset is 0 for Llama-style norms and 1 for Gemma's (1 + weight). Rows of x are x_stride
 * floats apart (a view of a wider tensor); out is contiguous.
 *
 * Every op takes `threads`: its rows (tokens) are split into that many contiguous ranges on the
 * calling thread's OpenMP team, which is torch's own (paged_decode.c's entry point says why).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

int rms_norm_f32(const float *restrict x, int64_t x_stride, const float *restrict w,
                 float w_offset, float *restrict out, int64_t rows, int64_t hidden, float eps,
                 int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * hidden;
        float ss = 0.0f;
        for (int64_t i = 0; i < hidden; i++)
            ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++)
            o[i] = (w[i] + w_offset) * (xr[i] * inv);
    }
    return 0;
}

/* rope_f32: transformers' rotary embedding (`x * cos + rotate_half(x) * sin`, rotate_half(x) =
 * cat(-x2, x1)) for one of q / k, out of place, where torch runs six kernels each writing a
 * new tensor. x: token t, head h at x + t * tok_stride + h * head_stride (unit stride along the
 * head's dims); out is contiguous [tokens, heads, head_dim]. cos / sin: [tokens, rot_dim]; the
 * first rot_dim dims of each head rotate (rot_dim even), the rest pass through unchanged. */
int rope_f32(const float *restrict x, int64_t tok_stride, int64_t head_stride,
             float *restrict out, int64_t tokens, int64_t heads, int64_t head_dim,
             const float *restrict cos_, const float *restrict sin_, int64_t rot_dim,
             int threads) {
    const int64_t half = rot_dim / 2;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_ + t * rot_dim, *s = sin_ + t * rot_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *v = x + t * tok_stride + h * head_stride;
            float *o = out + (t * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++)
                o[i] = v[i] * c[i] - v[i + half] * s[i];
            for (int64_t i = 0; i < half; i++)
                o[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
            for (int64_t i = rot_dim; i < head_dim; i++)
                o[i] = v[i];
        }
    }
    return 0;
}

/* bfloat16: the same ops on bf16 tensors, computed in float32 and rounded to bf16 (round to
 * nearest even) exactly where transformers' own bf16 code rounds, so each result is the bf16
 * value torch's eager ops give (the norm's mean square may be summed in another order: a rare
 * element then lands one bf16 step away).
 *
 * rms_norm_bf16: round_twice = 1 is Llama's `w * x_hat.to(bf16)` (x_hat rounded, then the
 * product); 0 is Gemma's `(x_hat * (1 + w.float())).type_as(x)` and OLMo-2's `(w * x_hat).to()`
 * (one rounding at the end). */
static inline float bf(uint16_t x) { return bf16_to_f32(x); }
static inline uint16_t to_bf(float f) { return f32_to_bf16(f); }
static inline float round_bf(float f) { return bf(to_bf(f)); }

int rms_norm_bf16(const uint16_t *restrict x, int64_t x_stride, const uint16_t *restrict w,
                  float w_offset, int round_twice, uint16_t *restrict out, int64_t rows,
                  int64_t hidden, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * hidden;
        float ss = 0.0f;
        for (int64_t i = 0; i < hidden; i++)
            ss += bf(xr[i]) * bf(xr[i]);
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        if (round_twice)
            for (int64_t i = 0; i < hidden; i++)
                o[i] = to_bf((bf(w[i]) + w_offset) * round_bf(bf(xr[i]) * inv));
        else
            for (int64_t i = 0; i < hidden; i++)
                o[i] = to_bf((bf(w[i]) + w_offset) * (bf(xr[i]) * inv));
    }
    return 0;
}

/* rope_bf16: rope_f32's layout with bf16 q/k and cos/sin; each product and the sum rounded to
 * bf16 as torch's bf16 `x * cos + rotate_half(x) * sin` rounds them. */
int rope_bf16(const uint16_t *restrict x, int64_t tok_stride, int64_t head_stride,
              uint16_t *restrict out, int64_t tokens, int64_t heads, int64_t head_dim,
              const uint16_t *restrict cos_, const uint16_t *restrict sin_, int64_t rot_dim,
              int threads) {
    const int64_t half = rot_dim / 2;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos_ + t * rot_dim, *s = sin_ + t * rot_dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *v = x + t * tok_stride + h * head_stride;
            uint16_t *o = out + (t * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++)
                o[i] = to_bf(round_bf(bf(v[i]) * bf(c[i])) - round_bf(bf(v[i + half]) * bf(s[i])));
            for (int64_t i = 0; i < half; i++)
                o[i + half] = to_bf(round_bf(bf(v[i + half]) * bf(c[i + half]))
                                    + round_bf(bf(v[i]) * bf(s[i + half])));
            for (int64_t i = rot_dim; i < head_dim; i++)
                o[i] = v[i];
        }
    }
    return 0;
}

/* argmax_rows: for each of `rows` rows of `cols` values (rows `stride` elements apart; float32,
 * or bf16 if is_bf16), the index of its first maximum, as torch's max(dim=-1).indices gives it
 * (-0 equals +0; a NaN counts as the maximum: the first NaN's index). The rows split across
 * `threads`.
 *
 * The values are compared as integers: a float's bits with the magnitude bits flipped under a
 * set sign bit (and negatives moved up by one, so -0 and +0 meet) order as the floats do, and
 * an integer max is a reduction the compiler vectorises (a float one it may not: NaN rules).
 * One pass keeps the first chunk that raised the maximum; the first index holding it is then
 * looked for in that chunk alone. */
#define ARGMAX_CHUNK 256
#define ARGMAX_ROW(NAME, UT, ST, SHIFT, ABS, INF)                                            \
    static inline ST NAME##_key(UT u) {                                                     \
        return (ST)(u ^ ((UT)((ST)u >> SHIFT) & ABS)) + (ST)(u >> SHIFT);                   \
    }                                                                                       \
    static int64_t NAME(const UT *v, int64_t cols) {                                        \
        ST best = 0; int64_t best_chunk = -1; int nan = 0;                                   \
        for (int64_t c = 0; c < cols; c += ARGMAX_CHUNK) {                                  \
            int64_t e = c + ARGMAX_CHUNK < cols ? c + ARGMAX_CHUNK : cols;                  \
            ST m = NAME##_key(v[c]);                                                        \
            for (int64_t i = c; i < e; i++) {                                               \
                ST k = NAME##_key(v[i]);                                                    \
                m = k > m ? k : m;                                                          \
                nan |= (v[i] & ABS) > INF;                                                  \
            }                                                                               \
            if (best_chunk < 0 || m > best) { best = m; best_chunk = c; }                    \
        }                                                                                   \
        if (nan) {                                                                          \
            for (int64_t i = 0; i < cols; i++)                                              \
                if ((v[i] & ABS) > INF) return i;                                           \
        }                                                                                   \
        for (int64_t i = best_chunk; i < cols; i++)                                         \
            if (NAME##_key(v[i]) == best) return i;                                         \
        return 0;                                                                           \
    }
ARGMAX_ROW(argmax_bf16, uint16_t, int16_t, 15, 0x7FFF, 0x7F80)
ARGMAX_ROW(argmax_f32, uint32_t, int32_t, 31, 0x7FFFFFFF, 0x7F800000)

int argmax_rows(const void *x, int is_bf16, int64_t stride, int64_t rows, int64_t cols,
                int64_t *restrict out, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        out[r] = is_bf16 ? argmax_bf16((const uint16_t *)x + r * stride, cols)
                         : argmax_f32((const uint32_t *)x + r * stride, cols);
    return 0;
}
