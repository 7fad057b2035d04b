/* Fused float32 elementwise ops for the CPU (loaded by cpu_fused.py with ctypes).
 *
 * rms_norm_f32: transformers' RMSNorm in one pass per row, where torch runs five kernels
 * (pow, mean, add, rsqrt, two muls), each writing a fresh [tokens, hidden] tensor:
 *     out[r] = (w + w_offset) * (x[r] * 1 / sqrt(mean(x[r]^2) + eps))
 * w_offset is 0 for Llama-style norms and 1 for Gemma's (1 + weight). Rows of x are x_stride
 * floats apart (a view of a wider tensor); out is contiguous.
 */
#include <math.h>
#include <stdint.h>

int rms_norm_f32(const float *restrict x, int64_t x_stride, const float *restrict w,
                 float w_offset, float *restrict out, int64_t rows, int64_t hidden, float eps) {
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
             const float *restrict cos_, const float *restrict sin_, int64_t rot_dim) {
    const int64_t half = rot_dim / 2;
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
