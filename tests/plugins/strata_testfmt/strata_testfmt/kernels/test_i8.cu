// test_i8 on the GPU: the example plugin's gather and MMQ, kept small and plain so they read as
// the contract rather than as an optimisation. Format: rows of 34-byte blocks, each an fp16
// scale d then 32 int8 q (weight = d * q); activations are fp16 (strata_rt's F16 encoding).
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"  // Ids16: the group's expert ids, the first MMQ parameter of every format

#define BLOCK 32
#define BLOCK_BYTES 34
#define TILE_M 64    // weight rows per block (one per thread); m must be a multiple
#define TILE_ROWS 8  // activation rows per row tile

// Gather: the blob is already the two images (gate rows, up rows | down rows), so one expert is
// two plain 16-byte copies, blockIdx.y 0 for gate/up and 1 for down. Both sizes are multiples of
// 16 bytes when the row counts divide by 32 (32 * 34 = 68 * 16); the launcher checks addresses.
extern "C" __global__ void test_i8_gather(const uint4* __restrict__ blob, uint4* __restrict__ gu,
                                          uint4* __restrict__ dn, long long gu_bytes,
                                          long long dn_bytes)
{
    const uint4* src = blockIdx.y == 0 ? blob : blob + gu_bytes / 16;
    uint4* dst = blockIdx.y == 0 ? gu : dn;
    const long long n = (blockIdx.y == 0 ? gu_bytes : dn_bytes) / 16;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

// MMQ under strata_rt's common ABI: arguments (ids, weights, acts, bounds, out, m, k), grid
// (m / TILE_M, group position, row tiles). Expert e = ids.v[blockIdx.y] owns activation rows
// bounds[e] .. bounds[e+1]-1; its image sits at weights + blockIdx.y * m * (k/32) * 34. Row
// tiles blockIdx.z, blockIdx.z + gridDim.z, ... so any grid depth covers every row.
//
// Thread t computes weight row m0 + t against up to TILE_ROWS rows at once, in float32 with
// every product and sum rounded on its own (the _rn intrinsics forbid FMA contraction):
//     for each block b:  dot = 0;  for j = 0..31:  dot = dot + q[b][j] * x[32b + j]
//                        acc = acc + d[b] * dot
// which TestI8.mmq_reference repeats step for step, so the two agree bit for bit.
extern "C" __global__ void __launch_bounds__(TILE_M)
test_i8_mmq(Ids16 ids, const uint8_t* __restrict__ weights, const __half* __restrict__ acts,
            const int* __restrict__ bounds, float* __restrict__ out, int m, int k)
{
    const int e = ids.v[blockIdx.y];
    if (e < 0) return;
    const int nb = k / BLOCK;
    const int i = blockIdx.x * TILE_M + threadIdx.x;
    const uint8_t* wrow = weights + ((size_t)blockIdx.y * m + i) * nb * BLOCK_BYTES;
    const int r_end = bounds[e + 1];
    for (int row0 = bounds[e] + blockIdx.z * TILE_ROWS; row0 < r_end;
         row0 += gridDim.z * TILE_ROWS) {
        const int nrows = min(TILE_ROWS, r_end - row0);
        const __half* x[TILE_ROWS];
        float acc[TILE_ROWS];
#pragma unroll
        for (int r = 0; r < TILE_ROWS; ++r) {
            x[r] = acts + (size_t)(row0 + min(r, nrows - 1)) * k;  // spare lanes repeat a row
            acc[r] = 0.0f;
        }
        for (int b = 0; b < nb; ++b) {
            const uint8_t* blk = wrow + (size_t)b * BLOCK_BYTES;
            const float d = __half2float(*reinterpret_cast<const __half*>(blk));
            float dot[TILE_ROWS];
#pragma unroll
            for (int r = 0; r < TILE_ROWS; ++r) dot[r] = 0.0f;
            for (int j = 0; j < BLOCK; ++j) {
                const float q = (float)(int8_t)blk[2 + j];
#pragma unroll
                for (int r = 0; r < TILE_ROWS; ++r)
                    dot[r] = __fadd_rn(dot[r], __fmul_rn(q, __half2float(x[r][b * BLOCK + j])));
            }
#pragma unroll
            for (int r = 0; r < TILE_ROWS; ++r) acc[r] = __fadd_rn(acc[r], __fmul_rn(d, dot[r]));
        }
#pragma unroll
        for (int r = 0; r < TILE_ROWS; ++r)
            if (r < nrows) out[(size_t)(row0 + r) * m + i] = acc[r];
    }
}
