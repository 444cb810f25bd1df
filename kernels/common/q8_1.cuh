// q8_1 activations in the MMQ layout (the fixed contract in strata_rt/formats/activations.py):
// a row of K values is K/128 blocks of 144 bytes: four float32 scales (one per 32 values),
// then 128 int8. Scale d = amax/127 (IEEE division), q = roundf(x / d) (IEEE division,
// half away from zero); an all-zero group has d = 0 and q = 0.
#pragma once

#define Q8_1_VALUES 128
#define Q8_1_BYTES 144

__device__ __forceinline__ signed char q8_1_round(float x, float d) {
    return (signed char)roundf(__fdiv_rn(x, d));
}

// Quantizes the 128 values one full warp holds, four per lane (lane l holds values
// 4l..4l+3), into the 144-byte block at `blk` (16-byte aligned). The eight lanes of a
// 32-value group agree on amax through shuffles, so no shared memory is needed and callers
// (the activation kernel, the fused SwiGLU+quantize kernel) can feed it straight from registers.
__device__ __forceinline__ void q8_1_quantize_warp128(float4 v, int lane, char* blk) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 4; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = __fdiv_rn(amax, 127.0f);
    char4 q = make_char4(0, 0, 0, 0);
    if (amax != 0.0f) {
        q.x = q8_1_round(v.x, d);
        q.y = q8_1_round(v.y, d);
        q.z = q8_1_round(v.z, d);
        q.w = q8_1_round(v.w, d);
    }
    reinterpret_cast<char4*>(blk + 16)[lane] = q;
    if ((lane & 7) == 0) reinterpret_cast<float*>(blk)[lane >> 3] = d;
}
