// bfloat16 <-> float32 for the engine's C kernels (paged_decode.c, fused_ops.c): a bf16 value is
// the top 16 bits of a float32, so widening is exact; narrowing rounds to nearest even, as
// torch's `.to(torch.bfloat16)` does. c_build hashes this header with each source that
// includes it.
#ifndef SHOAL_BF16_H
#define SHOAL_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
#endif
