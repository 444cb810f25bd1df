// Dequantizing gather for IQ3_XXS: up to 16 expert blobs -> their fp16 gate/up and down images
// in the group buffers, one launch per group (grid.y = position in the batch), so the grouped
// fp16 GEMM (kernels/common/gemm_f16.cu) can multiply them.
//
// A blob's gate+up range is the [2*ffn, hidden] matrix as row-major 98-byte blocks of 256
// values and its down range the [hidden, ffn] matrix likewise, so block i of a range holds
// values 256*i .. 256*i+255 of the row-major image: the image is the ranges' blocks decoded in
// order, whatever the geometry.
//
// Value (as quants/iq3_xxs.py: IQ3XXS.dequantize, exact in float32):
//     w = ((fp16 d * (0.5 + s)) * 0.5) * magnitude * sign
// d * (0.5 + s) has at most 11 + 5 significant bits and times a magnitude (<= 62, 6 bits) at
// most 22, so every product is exact; the image holds fp16(w), round to nearest even (the sign
// is applied before the rounding, which commutes with negation).
//
// One warp decodes one block per step: lane l writes the 16 bytes of values 8l .. 8l+7
// (sub-block l/4, sign group l%4), so each warp stores 512 contiguous bytes. Every warp loads
// GATHER_UNROLL blocks before decoding them, for enough reads in flight.
#include <cuda_fp16.h>
#include <stdint.h>

#include "iq3_xxs/grid.cuh"

#define IQ3_BLOCK 98
#define DQ_THREADS 256
#define DQ_WARPS (DQ_THREADS / 32)
#define DQ_UNROLL 4

struct Srcs16 { const uint8_t* v[16]; };

struct LaneBits {  // what one lane reads of a block
    unsigned short d, qs, word_lo, word_hi;
};

__device__ __forceinline__ LaneBits iq3_lane_load(const uint8_t* blk, int lane) {
    // blocks sit at even addresses; the sign/scale words are not always 4-byte aligned
    const unsigned short* h = reinterpret_cast<const unsigned short*>(blk);
    const int j = lane >> 2;  // sub-block
    LaneBits b;
    b.d = __ldg(h);
    b.qs = __ldg(h + 1 + lane);          // grid indices 2l, 2l+1 (bytes 2+2l, 3+2l)
    b.word_lo = __ldg(h + 33 + 2 * j);   // sign/scale word j at byte 66 + 4j
    b.word_hi = __ldg(h + 34 + 2 * j);
    return b;
}

__device__ __forceinline__ uint4 iq3_lane_decode(const LaneBits& b, const unsigned* s_grid,
                                                 int lane) {
    const unsigned word = (unsigned)b.word_lo | ((unsigned)b.word_hi << 16);
    const float d = __half2float(__ushort_as_half(b.d));
    const float db = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)(word >> 28))), 0.5f);
    const unsigned sidx = (word >> (7 * (lane & 3))) & 127u;
    const unsigned neg = sidx | ((__popc(sidx) & 1u) << 7);  // bit 7 restores even parity
    const unsigned g[2] = {s_grid[b.qs & 0xFF], s_grid[b.qs >> 8]};
    unsigned packed[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int v = 2 * i + half;  // value 8l + v: byte v & 3 of grid word v >> 2
            // the magnitude byte under the exponent of 2^23, minus 2^23: the byte as a float,
            // exactly, without the slow integer-to-float conversion
            const float mag = __fsub_rn(
                __uint_as_float(__byte_perm(g[v >> 2], 0x4B000000u, 0x7540u | (v & 3))),
                8388608.0f);
            // negating before the rounding equals negating after it (round to nearest even
            // is symmetric)
            f[half] = __uint_as_float(__float_as_uint(__fmul_rn(db, mag)) ^
                                      (((neg >> v) & 1u) << 31));
        }
        const __half2 h2 = __floats2half2_rn(f[0], f[1]);  // one cvt.rn.f16x2.f32, f[0] low
        packed[i] = *reinterpret_cast<const unsigned*>(&h2);
    }
    return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// srcs: blob addresses (even); expert i of the batch goes to position first_pos + i, its
// gate/up image at gu_buf + pos*gu_image and down image at down_buf + pos*dn_image (16-byte
// aligned). gu_off/dn_off: byte offsets of the ranges in a blob; gu_blocks/dn_blocks: their
// 98-byte blocks. bounds/first_expert: as gather_batch in kernels/common/gather.cu (a member
// whose expert first_expert + y has no rows in the layer's routing is skipped; null: none is).
extern "C" __global__ void __launch_bounds__(DQ_THREADS)
iq3_dequant_gather(Srcs16 srcs, uint8_t* gu_buf, uint8_t* down_buf, long long gu_off,
                   long long gu_blocks, long long dn_off, long long dn_blocks, long long gu_image,
                   long long dn_image, int first_pos, const int* __restrict__ bounds,
                   int first_expert)
{
    if (bounds != nullptr &&
        bounds[first_expert + blockIdx.y + 1] == bounds[first_expert + blockIdx.y]) return;
    __shared__ unsigned s_grid[256];
    for (int i = threadIdx.x; i < 256; i += DQ_THREADS) s_grid[i] = IQ3XXS_GRID[i];
    __syncthreads();

    const uint8_t* src = srcs.v[0];
    switch (blockIdx.y) {  // constant indices: a dynamic one would copy srcs to local memory
#define DQ_SRC(i) case i: src = srcs.v[i]; break;
        DQ_SRC(1) DQ_SRC(2) DQ_SRC(3) DQ_SRC(4) DQ_SRC(5) DQ_SRC(6) DQ_SRC(7) DQ_SRC(8)
        DQ_SRC(9) DQ_SRC(10) DQ_SRC(11) DQ_SRC(12) DQ_SRC(13) DQ_SRC(14) DQ_SRC(15)
#undef DQ_SRC
    }
    const long long pos = first_pos + (long long)blockIdx.y;
    const uint8_t* gu_src = src + gu_off;
    const uint8_t* dn_src = src + dn_off;
    uint8_t* gu_dst = gu_buf + pos * gu_image;
    uint8_t* dn_dst = down_buf + pos * dn_image;

    const int lane = threadIdx.x & 31;
    const long long total = gu_blocks + dn_blocks;
    const long long nw = (long long)gridDim.x * DQ_WARPS;
    for (long long w0 = (long long)blockIdx.x * DQ_WARPS + (threadIdx.x >> 5); w0 < total;
         w0 += DQ_UNROLL * nw) {
        LaneBits bits[DQ_UNROLL];
#pragma unroll
        for (int u = 0; u < DQ_UNROLL; ++u) {
            const long long b = w0 + u * nw;
            if (b < total)
                bits[u] = iq3_lane_load(b < gu_blocks ? gu_src + b * IQ3_BLOCK
                                                      : dn_src + (b - gu_blocks) * IQ3_BLOCK,
                                        lane);
        }
#pragma unroll
        for (int u = 0; u < DQ_UNROLL; ++u) {
            const long long b = w0 + u * nw;
            if (b >= total) break;
            uint8_t* dst = b < gu_blocks ? gu_dst + b * 512 : dn_dst + (b - gu_blocks) * 512;
            reinterpret_cast<uint4*>(dst)[lane] = iq3_lane_decode(bits[u], s_grid, lane);
        }
    }
}
