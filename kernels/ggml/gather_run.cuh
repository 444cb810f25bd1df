// The batched dequantizing gather's body (STRATA_GGML_GATHER in templates.cuh instantiates it
// per decoder): a warp stages the raw bytes of a few consecutive 256-value groups into shared
// memory with 16-byte loads, then decodes them from there, 8 values a lane.
//
// Why staged: a decoder reads its block a field at a time (d, scales, quant planes: 3-10 loads
// per 8 values, several of them single bytes), each load waiting on global memory if issued
// straight from the source, and a decoded chunk is stored before the next chunk's loads
// issue. Staging issues every load of GROUPS_PER_STEP groups at once, as wide loads, before
// any decoding; the decoders' many small reads then hit shared memory.
//
// Layout: the matrix is whole blocks, row after row, so values 256g .. 256g + 255 (group g)
// are bytes g * SPAN .. of the source, SPAN = 256 * block_bytes / block_values (every GGML
// block holds 1, 32 or 256 values). Group g's image is 512 bytes at 512g; lane l writes
// values 256g + 8l .. + 7 (one 16-byte store). The source may start at any byte: the staged
// copy starts at the 16-byte boundary below the step's first byte, keeping the source's
// alignment within 16, and the 16-byte words the step's bytes only partly cover are read a
// byte at a time, so nothing outside [source, source + bytes) is read.
#pragma once

#include <stdint.h>

#include "decoder.cuh"

#define GGML_GATHER_THREADS 256
#define GGML_GATHER_WARPS (GGML_GATHER_THREADS / 32)
// bytes a warp aims to stage per step (a step's groups: this over SPAN, 1 to 8)
#define GGML_GATHER_STEP_BYTES 1024

namespace ggml {

template <class D> struct GatherStep {
    static_assert(256 % D::block_values == 0, "a 256-value group is whole blocks");
    static constexpr int SPAN = 256 / D::block_values * D::block_bytes;  // bytes of a group
    static constexpr int GROUPS_RAW = GGML_GATHER_STEP_BYTES / SPAN;
    static constexpr int GROUPS = GROUPS_RAW < 1 ? 1 : (GROUPS_RAW > 8 ? 8 : GROUPS_RAW);
    // the staged words: a step's bytes plus up to 15 before them (the alignment kept)
    static constexpr int WORDS = (GROUPS * SPAN + 15) / 16 + 1;
};

// Bytes [lo, hi) of global memory into the warp's stage (16-byte words, stage word k holding
// bytes from (lo & ~15) + 16k); lanes share the words. Returns the stage address of byte lo.
__device__ __forceinline__ const uint8_t* gather_stage(const uint8_t* lo, const uint8_t* hi,
                                                       uint4* stage, int words, int lane) {
    const uintptr_t a0 = (uintptr_t)lo & ~(uintptr_t)15;
    const uintptr_t end = (uintptr_t)hi;
    for (int k = lane; k < words; k += 32) {
        const uintptr_t w = a0 + 16 * (uintptr_t)k;
        if (w >= end) break;
        if (w >= (uintptr_t)lo && w + 16 <= end) {
            stage[k] = __ldg(reinterpret_cast<const uint4*>(w));
        } else {  // a word the range only partly covers: its bytes inside, one at a time
            uint8_t* s = reinterpret_cast<uint8_t*>(stage + k);
            for (int b = 0; b < 16; ++b)
                if (w + b >= (uintptr_t)lo && w + b < end) s[b] = *reinterpret_cast<const uint8_t*>(w + b);
        }
    }
    return reinterpret_cast<const uint8_t*>(stage) + ((uintptr_t)lo - a0);
}

template <class D>
__device__ __forceinline__ void gather_run(const GgmlSrcs16& srcs, uint8_t* dst,
                                           long long image_bytes, long long values,
                                           int first_pos, const int* __restrict__ bounds,
                                           int first_expert) {
    using S = GatherStep<D>;
    __shared__ uint4 stages[GGML_GATHER_WARPS][S::WORDS];
    const int y = blockIdx.y;
    if (bounds != nullptr && bounds[first_expert + y + 1] == bounds[first_expert + y]) return;
    const uint8_t* src = srcs.v[0];
    switch (y) {  // constant indices: a dynamic one would copy srcs to local memory
#define GGML_SRC(i) case i: src = srcs.v[i]; break;
        GGML_SRC(1) GGML_SRC(2) GGML_SRC(3) GGML_SRC(4) GGML_SRC(5) GGML_SRC(6) GGML_SRC(7)
        GGML_SRC(8) GGML_SRC(9) GGML_SRC(10) GGML_SRC(11) GGML_SRC(12) GGML_SRC(13)
        GGML_SRC(14) GGML_SRC(15)
#undef GGML_SRC
    }
    if (src == nullptr) return;
    uint4* out = reinterpret_cast<uint4*>(dst + (long long)(first_pos + y) * image_bytes);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint4* stage = stages[warp];
    const long long chunks = values / 8;
    const long long groups = (chunks + 31) / 32;
    const long long src_bytes = values / D::block_values * D::block_bytes;
    const long long warps = (long long)gridDim.x * GGML_GATHER_WARPS;
    for (long long g0 = ((long long)blockIdx.x * GGML_GATHER_WARPS + warp) * S::GROUPS;
         g0 < groups; g0 += warps * S::GROUPS) {
        const long long first = g0 * S::SPAN;
        const long long last = (g0 + S::GROUPS) * S::SPAN;
        const uint8_t* base = gather_stage(src + first, src + (last < src_bytes ? last : src_bytes),
                                           stage, S::WORDS, lane);
        __syncwarp();
#pragma unroll
        for (int u = 0; u < S::GROUPS; ++u) {
            const long long c = (g0 + u) * 32 + lane;
            if (c < chunks) {
                unsigned w[4];
                chunk8_f16_float<D>(base + u * S::SPAN, lane, w);
                out[c] = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
        __syncwarp();  // every lane's reads of the stage done before the next step fills it
    }
}

}  // namespace ggml
