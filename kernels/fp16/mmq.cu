// FP16 grouped GEMM ("MMQ" of the fp16 format): out[r, :] = W_e x_r for every activation row r
// of every expert e of a group; W is the fp16 image (m x k row-major), x the fp16 activations
// (row-major [rows, k], sorted by expert), accumulation in fp32 by mma.sync m16n8k16.
//
// grid = (m / TILE_M, group position, row tiles), the MMQ ABI every format shares (arguments
// ids, weights, acts, bounds, out, m, k); block = 4 warps, each owning 32 activation
// rows x 32 weight rows of the block's 64 x 64 tile; k advances 64 values per step through
// shared memory. Tensor-core accumulation order is not IEEE-sequential, so the numpy reference
// (float32 product of the fp16 values) agrees within a tolerance, not bit for bit.
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "common/tile64.cuh"

#define TILE_M 64     // weight rows per block
#define TILE_N 64     // activation rows per block
#define KSTEP 64      // values per step
#define SROW TILE64_SROW
#define NTHREADS 128

// One TILE_N x TILE_M output tile: activation rows row0 .. row0+nrows-1 against weight rows
// m0 .. m0+TILE_M-1 of one expert's image w.
__device__ __forceinline__ void fp16_tile(const uint8_t* __restrict__ w,
                                          const uint8_t* __restrict__ acts,
                                          float* __restrict__ out, int m, int k, int m0,
                                          int row0, int nrows)
{
    __shared__ __align__(16) uint8_t s_act[TILE_N * SROW];
    __shared__ __align__(16) uint8_t s_w[TILE_M * SROW];

    const int tid = threadIdx.x;
    const Tile64Lane L(tid);

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;

    for (int k0 = 0; k0 < k; k0 += KSTEP) {
        // 64 values = 128 bytes = 8 x 16 bytes per row
        for (int i = tid; i < TILE_N * 8; i += NTHREADS) {
            const int r = i >> 3, c = i & 7;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (r < nrows) v = *(const uint4*)(acts + ((size_t)(row0 + r) * k + k0) * 2 + c * 16);
            *(uint4*)(s_act + r * SROW + c * 16) = v;
        }
        for (int i = tid; i < TILE_M * 8; i += NTHREADS) {
            const int r = i >> 3, c = i & 7;
            *(uint4*)(s_w + r * SROW + c * 16) =
                *(const uint4*)(w + ((size_t)(m0 + r) * k + k0) * 2 + c * 16);
        }
        __syncthreads();

#pragma unroll
        for (int kk = 0; kk < KSTEP; kk += 16) {
            const int kofs = (kk + 2 * L.t) * 2;  // byte offset of this thread's first pair
            unsigned a[2][4], b[4][2];
            tile64_fragments(a, b, s_act, s_w, L, kofs);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
                    mma_f16_16x8x16(acc[mt][nt], a[mt], b[nt][0], b[nt][1], acc[mt][nt]);
        }
        __syncthreads();
    }

    tile64_store(acc, out, m, m0, row0, nrows, L);
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
fp16_mmq(Ids16 ids, const uint8_t* __restrict__ weights, const uint8_t* __restrict__ acts,
         const int* __restrict__ bounds, float* __restrict__ out, int m, int k)
{
    const int e = ids.v[blockIdx.y];
    if (e < 0) return;
    const int r_end = bounds[e + 1];
    const uint8_t* w = weights + (size_t)blockIdx.y * m * k * 2;
    // Row tiles blockIdx.z, blockIdx.z + gridDim.z, ...: any grid depth is correct, so the
    // launcher may size it from an estimate when the row counts live only on the device.
    for (int row0 = bounds[e] + blockIdx.z * TILE_N; row0 < r_end; row0 += gridDim.z * TILE_N)
        fp16_tile(w, acts, out, m, k, blockIdx.x * TILE_M, row0, min(TILE_N, r_end - row0));
}
