// Expert gathers for native formats: an expert blob is plain byte ranges (gate/up image,
// down image) copied into the expert's position of the group buffers.
// gather_one: any alignment (16-byte copies where source and destination share their
// alignment, bytes otherwise). gather_batch: up to 16 experts, grid.y = position in the batch,
// 16-byte copies only; the host calls it only when every address and size is a multiple of 16.
// With `bounds` (a layer's row offsets from the counting sort) the batch holds experts
// first_expert + y, and one whose routing gave it no rows is skipped: a decode step replayed as
// a CUDA graph gathers only its routed experts (from resident slots, or from page-locked host
// memory over PCIe). bounds = null gathers every member.
#include <stdint.h>

struct Ptrs16 { const char* v[16]; };

#define GATHER_UNROLL 4

// Copies n16 uint4 words, GATHER_UNROLL loads in flight per thread for bandwidth.
__device__ __forceinline__ void copy16(uint4* __restrict__ dst, const uint4* __restrict__ src,
                                       long long n16, long long t, long long nt) {
    long long i = t;
    for (; i + (GATHER_UNROLL - 1) * nt < n16; i += GATHER_UNROLL * nt) {
        uint4 v[GATHER_UNROLL];
#pragma unroll
        for (int u = 0; u < GATHER_UNROLL; ++u) v[u] = __ldg(src + i + u * nt);
#pragma unroll
        for (int u = 0; u < GATHER_UNROLL; ++u) dst[i + u * nt] = v[u];
    }
    for (; i < n16; i += nt) dst[i] = __ldg(src + i);
}

// Any alignment: a byte head up to dst's 16-byte boundary, 16-byte body, byte tail when
// src and dst are equally misaligned; a plain byte loop when they are not.
__device__ void copy_any(char* dst, const char* src, long long n, long long t, long long nt) {
    if ((((uintptr_t)dst ^ (uintptr_t)src) & 15) == 0) {
        long long head = (16 - ((uintptr_t)dst & 15)) & 15;
        if (head > n) head = n;
        const long long n16 = (n - head) >> 4;
        for (long long i = t; i < head; i += nt) dst[i] = src[i];
        copy16(reinterpret_cast<uint4*>(dst + head), reinterpret_cast<const uint4*>(src + head),
               n16, t, nt);
        const long long done = head + (n16 << 4);
        for (long long i = done + t; i < n; i += nt) dst[i] = src[i];
    } else {
        for (long long i = t; i < n; i += nt) dst[i] = src[i];
    }
}

extern "C" __global__ void __launch_bounds__(256)
gather_one(const char* src, char* gu_dst, char* down_dst, long long gu_off, long long gu_bytes,
           long long dn_off, long long dn_bytes) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nt = (long long)gridDim.x * blockDim.x;
    copy_any(gu_dst, src + gu_off, gu_bytes, t, nt);
    copy_any(down_dst, src + dn_off, dn_bytes, t, nt);
}

extern "C" __global__ void __launch_bounds__(256)
gather_batch(Ptrs16 srcs, char* gu_buf, char* down_buf, long long gu_off, long long gu_bytes,
             long long dn_off, long long dn_bytes, long long gu_image, long long dn_image,
             int first_pos, const int* __restrict__ bounds, int first_expert) {
    const int i = blockIdx.y;
    if (bounds != nullptr && bounds[first_expert + i + 1] == bounds[first_expert + i]) return;
    const char* src = srcs.v[i];
    const long long pos = first_pos + i;
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nt = (long long)gridDim.x * blockDim.x;
    copy16(reinterpret_cast<uint4*>(gu_buf + pos * gu_image),
           reinterpret_cast<const uint4*>(src + gu_off), gu_bytes >> 4, t, nt);
    copy16(reinterpret_cast<uint4*>(down_buf + pos * dn_image),
           reinterpret_cast<const uint4*>(src + dn_off), dn_bytes >> 4, t, nt);
}
