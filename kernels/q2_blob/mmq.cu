// Q2 blob grouped MMQ: out[r, :] = W_e x_r for every activation row r of every expert e of a
// group, W from the de-interleaved image (codes m x k/4, then fp16 scales m x k/64), x as q8_1.
//
// grid = (m / TILE_M, group position, row tiles), the MMQ ABI every format shares (arguments
// ids, weights, acts, bounds, out, m, k); block = 4 warps, each owning 32 activation
// rows x 32 weight rows of the block's 64 x 64 tile. Per 128-value step the block stages the
// activations' int8 q and the weights' levels (code - 1, unpacked to int8) in shared memory;
// mma.sync m16n8k32 s8 gives the exact integer dot of each 32-value sub-block. The float part
// runs in a fixed order mirrored by the numpy reference (quants/q2_blob.py):
//   for each sub-block j ascending:
//     acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(ws, d_j), (float)idot_j))
// with ws the fp16 scale of the 64-group holding j and d_j the activation's q8_1 scale.
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "common/tile64.cuh"

#define TILE_M 64     // weight rows per block
#define TILE_N 64     // activation rows per block
#define KSTEP 128     // values per step (one q8_1 block)
#define SROW TILE64_SROW
#define NTHREADS 128
#define Q8_BLOCK 144  // bytes of one q8_1 block: 4 float scales + 128 int8

// Four 2-bit codes (one byte, low bits first) -> four int8 levels code - 1.
__device__ __forceinline__ uint32_t levels4(uint32_t byte)
{
    const uint32_t spread = (byte & 0x03u) | ((byte & 0x0Cu) << 6) | ((byte & 0x30u) << 12) |
                            ((byte & 0xC0u) << 18);
    return __vsub4(spread, 0x01010101u);
}

// One TILE_N x TILE_M output tile: activation rows row0 .. row0+nrows-1 against weight rows
// m0 .. m0+TILE_M-1 of one expert's image (codes, then scales).
__device__ __forceinline__ void q2_tile(const uint8_t* __restrict__ codes,
                                        const __half* __restrict__ scales,
                                        const uint8_t* __restrict__ acts, float* __restrict__ out,
                                        int m, int k, int m0, int row0, int nrows)
{
    const int nkb = k / KSTEP;

    __shared__ __align__(16) int8_t s_act[TILE_N * SROW];
    __shared__ __align__(16) int8_t s_w[TILE_M * SROW];
    __shared__ float s_d[TILE_N][4];
    __shared__ float s_ws[TILE_M][2];

    const int tid = threadIdx.x;
    const Tile64Lane L(tid);

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;

    for (int kb = 0; kb < nkb; ++kb) {
        // activations: 8 x 16 bytes of q per row, zeros past the expert's last row
        for (int i = tid; i < TILE_N * 8; i += NTHREADS) {
            const int r = i >> 3, c = i & 7;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (r < nrows)
                v = *(const uint4*)(acts + ((size_t)(row0 + r) * nkb + kb) * Q8_BLOCK + 16 + c * 16);
            *(uint4*)(s_act + r * SROW + c * 16) = v;
        }
        for (int i = tid; i < TILE_N * 4; i += NTHREADS) {
            const int r = i >> 2, j = i & 3;
            s_d[r][j] = r < nrows
                ? ((const float*)(acts + ((size_t)(row0 + r) * nkb + kb) * Q8_BLOCK))[j] : 0.0f;
        }
        // weights: 32 code bytes per row -> 128 int8 levels
        for (int i = tid; i < TILE_M * 2; i += NTHREADS) {
            const int r = i >> 1, c = i & 1;
            const uint4 v = *(const uint4*)(codes + (size_t)(m0 + r) * (k / 4) + kb * 32 + c * 16);
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
            uint4* dst = (uint4*)(s_w + r * SROW + c * 64);
#pragma unroll
            for (int q = 0; q < 4; ++q)
                dst[q] = make_uint4(levels4(w[q] & 0xFF), levels4((w[q] >> 8) & 0xFF),
                                    levels4((w[q] >> 16) & 0xFF), levels4(w[q] >> 24));
        }
        for (int i = tid; i < TILE_M * 2; i += NTHREADS) {
            const int r = i >> 1, c = i & 1;
            s_ws[r][c] = __half2float(scales[(size_t)(m0 + r) * (k / 64) + kb * 2 + c]);
        }
        __syncthreads();

#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int kofs = j * 32 + 4 * L.t;
            unsigned a[2][4], b[4][2];
            tile64_fragments(a, b, s_act, s_w, L, kofs);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const float d_lo = s_d[L.wa + mt * 16 + L.g][j];
                const float d_hi = s_d[L.wa + mt * 16 + L.g + 8][j];
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    int c[4];
                    mma_s8_16x8x32(c, a[mt], b[nt][0], b[nt][1]);
                    const float ws0 = s_ws[L.ww + nt * 8 + 2 * L.t][j >> 1];
                    const float ws1 = s_ws[L.ww + nt * 8 + 2 * L.t + 1][j >> 1];
                    float* x = acc[mt][nt];
                    x[0] = __fadd_rn(x[0], __fmul_rn(__fmul_rn(ws0, d_lo), (float)c[0]));
                    x[1] = __fadd_rn(x[1], __fmul_rn(__fmul_rn(ws1, d_lo), (float)c[1]));
                    x[2] = __fadd_rn(x[2], __fmul_rn(__fmul_rn(ws0, d_hi), (float)c[2]));
                    x[3] = __fadd_rn(x[3], __fmul_rn(__fmul_rn(ws1, d_hi), (float)c[3]));
                }
            }
        }
        __syncthreads();
    }

    tile64_store(acc, out, m, m0, row0, nrows, L);
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
q2_mmq(Ids16 ids, const uint8_t* __restrict__ weights, const uint8_t* __restrict__ acts,
       const int* __restrict__ bounds, float* __restrict__ out, int m, int k)
{
    const int e = ids.v[blockIdx.y];
    if (e < 0) return;
    const int r_end = bounds[e + 1];
    const size_t code_bytes = (size_t)m * (k / 4);
    const uint8_t* codes = weights + (size_t)blockIdx.y * (code_bytes + (size_t)m * (k / 64) * 2);
    const __half* scales = (const __half*)(codes + code_bytes);
    // Row tiles blockIdx.z, blockIdx.z + gridDim.z, ...: any grid depth is correct, so the
    // launcher may size it from an estimate when the row counts live only on the device.
    for (int row0 = bounds[e] + blockIdx.z * TILE_N; row0 < r_end; row0 += gridDim.z * TILE_N)
        q2_tile(codes, scales, acts, out, m, k, blockIdx.x * TILE_M, row0,
                min(TILE_N, r_end - row0));
}
