// The 64 x 64 output tile of a per-expert MMQ kernel (q2_blob's int8 MMQ; a plugin's may use it
// too): four warps, each owning 32 activation rows x 32 weight rows; operands sit in shared
// memory as rows of TILE64_SROW bytes (128 bytes of one K step + 16 of padding, which keeps the
// fragment loads free of bank conflicts).
#pragma once
#include <stdint.h>

#define TILE64_SROW 144

struct Tile64Lane {
    int g, t;    // mma fragment coordinates of this lane (row group, thread in group)
    int wa, ww;  // this warp's first activation row and first weight row in the tile
    __device__ Tile64Lane(int tid)
        : g((tid & 31) >> 2), t(tid & 3), wa((tid >> 6) * 32), ww(((tid >> 5) & 1) * 32) {}
};

// A fragments (2 x m16, activations) and B fragments (4 x n8, weights) at byte offset kofs of
// every shared row: 16 bytes of K per fragment row, either 8 fp16 or 16 int8 values.
__device__ __forceinline__ void tile64_fragments(unsigned (&a)[2][4], unsigned (&b)[4][2],
                                                 const void* s_act, const void* s_w,
                                                 const Tile64Lane& L, int kofs) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const uint8_t* p = (const uint8_t*)s_act + (L.wa + mt * 16 + L.g) * TILE64_SROW + kofs;
        a[mt][0] = *(const uint32_t*)p;
        a[mt][1] = *(const uint32_t*)(p + 8 * TILE64_SROW);
        a[mt][2] = *(const uint32_t*)(p + 16);
        a[mt][3] = *(const uint32_t*)(p + 8 * TILE64_SROW + 16);
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const uint8_t* p = (const uint8_t*)s_w + (L.ww + nt * 8 + L.g) * TILE64_SROW + kofs;
        b[nt][0] = *(const uint32_t*)p;
        b[nt][1] = *(const uint32_t*)(p + 16);
    }
}

// Writes the warp's accumulators: activation row row0 + r (r < nrows) of out [*, m], columns
// from m0; rows past nrows belong to the next expert and are left alone.
__device__ __forceinline__ void tile64_store(const float (&acc)[2][4][4], float* __restrict__ out,
                                             int m, int m0, int row0, int nrows,
                                             const Tile64Lane& L) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const int r = L.wa + mt * 16 + L.g;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int col = m0 + L.ww + nt * 8 + 2 * L.t;
            if (r < nrows)
                *(float2*)(out + (size_t)(row0 + r) * m + col) =
                    make_float2(acc[mt][nt][0], acc[mt][nt][1]);
            if (r + 8 < nrows)
                *(float2*)(out + (size_t)(row0 + r + 8) * m + col) =
                    make_float2(acc[mt][nt][2], acc[mt][nt][3]);
        }
    }
}
