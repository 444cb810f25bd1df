// FP16 gather: the blob already is the two images (gate rows + up rows, then down rows, fp16
// row-major), so one expert is two plain copies in one launch (blockIdx.y: 0 gate/up, 1 down),
// 16 bytes at a time. The format is not native by the project's rule, so it never batches.
// All addresses and sizes must be multiples of 16 bytes (the host launcher checks addresses;
// sizes are multiples of 16 when hidden and ffn divide by 128).
#include <stdint.h>

extern "C" __global__ void fp16_gather(const uint8_t* __restrict__ blob, uint8_t* __restrict__ gu,
                                       uint8_t* __restrict__ dn, long long gu_bytes,
                                       long long dn_bytes)
{
    const uint4* src = (const uint4*)(blockIdx.y == 0 ? blob : blob + gu_bytes);
    uint4* dst = (uint4*)(blockIdx.y == 0 ? gu : dn);
    const long long n = (blockIdx.y == 0 ? gu_bytes : dn_bytes) / 16;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
