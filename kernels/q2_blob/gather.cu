// Q2 blob gather: rebuilds one expert's MMQ-ready images from its planar blob (one launch per
// expert; the format is not native, so it never batches).
//
// blob planes: gate/up codes (2f x h/4, rows interleaved gate k / up k), down codes (h x f/4),
// gate/up scales (2f x h/64 fp16, same interleave), down scales (h x f/64 fp16).
// gate/up image: codes of gate rows, codes of up rows, scales of gate rows, scales of up rows.
// down image:    down codes, down scales (both contiguous in the blob already).
//
// blockIdx.y picks the part: 0 gate/up codes, 1 gate/up scales, 2 down codes, 3 down scales.
// Codes and the contiguous parts move 16 bytes at a time; a row of gate/up scales is h/32 bytes
// (a multiple of 4 when h divides by 128), so that part moves 4 bytes at a time.
// All addresses must be 16-byte aligned (the host launcher checks).
#include <stdint.h>

template <typename T>
__device__ __forceinline__ void copy_rows(const T* __restrict__ src, T* __restrict__ dst,
                                          long long rows, long long row_units, bool deinterleave,
                                          long long half_rows)
{
    const long long total = rows * row_units;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / row_units;
        const long long u = i - r * row_units;
        long long sr = r;
        if (deinterleave) sr = r < half_rows ? 2 * r : 2 * (r - half_rows) + 1;
        dst[i] = src[sr * row_units + u];
    }
}

extern "C" __global__ void q2_gather(const uint8_t* __restrict__ blob, uint8_t* __restrict__ gu,
                                     uint8_t* __restrict__ dn, int hidden, int ffn)
{
    const long long h = hidden, f = ffn;
    const long long gu_codes = 2 * f * h / 4, dn_codes = h * f / 4;
    const long long gu_scales = 2 * f * (h / 64) * 2, dn_scales = h * (f / 64) * 2;
    const uint8_t* p_gs = blob + gu_codes + dn_codes;
    switch (blockIdx.y) {
    case 0:  // gate/up codes: 2f rows of h/4 bytes, de-interleaved
        copy_rows((const uint4*)blob, (uint4*)gu, 2 * f, h / 64, true, f);
        break;
    case 1:  // gate/up scales: 2f rows of h/32 bytes, de-interleaved
        copy_rows((const uint32_t*)p_gs, (uint32_t*)(gu + gu_codes), 2 * f, h / 128, true, f);
        break;
    case 2:  // down codes
        copy_rows((const uint4*)(blob + gu_codes), (uint4*)dn, 1, dn_codes / 16, false, 0);
        break;
    default:  // down scales
        copy_rows((const uint4*)(p_gs + gu_scales), (uint4*)(dn + dn_codes), 1, dn_scales / 16,
                  false, 0);
        break;
    }
}
