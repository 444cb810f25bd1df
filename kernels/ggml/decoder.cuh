// The decoder-struct contract every shared GGML template is written against, and the two
// walks over a run of blocks that the gather and the host test share.
//
// A decoder is a struct D with
//   static constexpr int block_values;   // 1, or a multiple of 8
//   static constexpr int block_bytes;
//   static Pair pair(const uint8_t* block, int i);   // values i, i + 1 (i even) as float32
// (any return type with float members x and y will do). ggml::Decode<T> of decode.cuh is one
// per built-in type; a plugin writes its own struct (kernels/ggml/templates.cuh instantiates
// the kernels for it). A 1-value type's pair spans two consecutive blocks: pair(b, 0) reads
// the blocks at b and b + block_bytes.
//
// Host and device code: the CPU test runs these walks as host code against the gguf package.
#pragma once

#include "decode_common.cuh"

#ifndef STRATA_GGML_HOST
#include <cuda_fp16.h>

#include <type_traits>
#endif

namespace ggml {

// Values v and v + 1 (v even) of a run of blocks stored one after the other from `src` (a
// tensor's rows, which follow each other): block v / values at in-block index v % values.
template <class D> GGML_HD Pair pair_of(const uint8_t* src, long long v) {
    if (D::block_values == 1) {
        const auto p = D::pair(src + v * D::block_bytes, 0);
        return {p.x, p.y};
    }
    const auto p = D::pair(src + (v / D::block_values) * D::block_bytes,
                           (int)(v % D::block_values));
    return {p.x, p.y};
}

// A decoder may also give `static void chunk8(const uint8_t* block, int i, Pair (&out)[4])`:
// values i .. i + 7 (i a multiple of 8) as four pairs, the same bits as four pair() calls, with
// what the eight share (a sub-block's scale, its bit positions) worked out once. The walks
// below take it where it exists (chunk8_hook: the int overload wins overload resolution when
// D::chunk8 is well formed), four pair() calls otherwise.
template <class D>
GGML_HD auto chunk8_hook(const uint8_t* b, int i, Pair (&out)[4], int)
    -> decltype(D::chunk8(b, i, out), bool()) {
    D::chunk8(b, i, out);
    return true;
}
template <class D> GGML_HD bool chunk8_hook(const uint8_t*, int, Pair (&)[4], long) {
    return false;
}

// A decoder whose eight values i .. i + 7 (i a multiple of 8) share what `D::scale(block, i)`
// returns (a sub-block's scale, its grid entry, its sign bits): value j is
// `D::value(block, j, scale)`. Deriving from SubBlock<D> gives pair() and chunk8() from those
// two, so each value is computed once, in one place (a decoder's own chunk8, which reads the
// eight values' bits at once, hides this one).
template <class D> struct SubBlock {
    GGML_HD static Pair pair(const uint8_t* b, int i) {
        const auto s = D::scale(b, i);
        return {D::value(b, i, s), D::value(b, i + 1, s)};
    }
    GGML_HD static void chunk8(const uint8_t* b, int i, Pair (&out)[4]) {
        const auto s = D::scale(b, i);
GGML_UNROLL
        for (int p = 0; p < 4; ++p) out[p] = {D::value(b, i + 2 * p, s), D::value(b, i + 2 * p + 1, s)};
    }
};

// Values 8c .. 8c + 7 of a run of blocks as four pairs: what one gather thread writes (one
// 16-byte store). Every block holds 1 or a multiple of 8 values, so the 8 share one block (or
// are 8 consecutive 1-value blocks) and the block is addressed once.
template <class D> GGML_HD void chunk8_of(const uint8_t* src, long long c, Pair (&out)[4]) {
    static_assert(D::block_values == 1 || D::block_values % 8 == 0, "8 values per block");
    if (D::block_values == 1) {
        const uint8_t* b = src + 8 * c * D::block_bytes;
GGML_UNROLL
        for (int p = 0; p < 4; ++p) {
            const auto v = D::pair(b + 2 * p * D::block_bytes, 0);
            out[p] = {v.x, v.y};
        }
    } else {
        const long long v = 8 * c;
        const uint8_t* b = src + (v / D::block_values) * D::block_bytes;
        const int i = (int)(v % D::block_values);
        if (chunk8_hook<D>(b, i, out, 0)) return;
GGML_UNROLL
        for (int p = 0; p < 4; ++p) {
            const auto w = D::pair(b, i + 2 * p);
            out[p] = {w.x, w.y};
        }
    }
}

#ifndef STRATA_GGML_HOST
// On the device a decoder may also give `static __device__ void chunk8_h2(const uint8_t* block,
// int i, unsigned (&out)[4], const Shared& tables)`: values i .. i + 7 (i a multiple of 8; a
// 1-value type: the 8 blocks from `block`, i = 0) as
// four fp16x2 words (value i + 2p in the low half of word p), each the fp16 value (round to
// nearest even) of what chunk8 returns, bit for bit, computed in fp16 arithmetic where that is
// exact. `Shared` is the decoder's struct of tables a block keeps in shared memory and
// `static __device__ void fill_shared(Shared&)` fills it (every thread of the block calls it,
// a barrier follows); a decoder without tables gives neither and takes `chunk8_h2(block, i,
// out)`. chunk8_h2 may assume the block starts at an even address (GGML blocks are of even
// size, the parts that hold them start aligned). The matrix-vector kernels take it through
// chunk8_f16_at.
template <class D, class = void> struct SharedOf {
    struct Type {};
    __device__ static void fill(Type&) {}
};
template <class D> struct SharedOf<D, std::void_t<typename D::Shared>> {
    using Type = typename D::Shared;
    __device__ static void fill(Type& tables) { D::fill_shared(tables); }
};
// the block-shared tables of decoder D (an empty struct for most)
template <class D> using shared_of = typename SharedOf<D>::Type;

template <class D, class S>
__device__ __forceinline__ auto chunk8_h2_hook(const uint8_t* b, int i, unsigned (&out)[4],
                                               const S& tables, int)
    -> decltype(D::chunk8_h2(b, i, out, tables), bool()) {
    D::chunk8_h2(b, i, out, tables);
    return true;
}
template <class D, class S>
__device__ __forceinline__ auto chunk8_h2_hook(const uint8_t* b, int i, unsigned (&out)[4],
                                               const S&, long)
    -> decltype(D::chunk8_h2(b, i, out), bool()) {
    D::chunk8_h2(b, i, out);
    return true;
}
template <class D, class S>
__device__ __forceinline__ bool chunk8_h2_hook(const uint8_t*, int, unsigned (&)[4], const S&,
                                               ...) {
    return false;
}

// Values 8c .. 8c + 7 of a run of blocks as four fp16x2 words (value 8c + 2p low in word p),
// each rounded to nearest even from the float32 path: what the gathers store (the path their
// byte-exact GPU test holds).
template <class D>
__device__ __forceinline__ void chunk8_f16_float(const uint8_t* src, long long c,
                                                 unsigned (&out)[4]) {
    Pair p[4];
    chunk8_of<D>(src, c, p);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const __half2 h = __floats2half2_rn(p[q].x, p[q].y);
        out[q] = *reinterpret_cast<const unsigned*>(&h);
    }
}

// The same values with the block's filled tables at hand (shared_of<D>): the decoder's
// chunk8_h2 where it has one, chosen at compile time so no other path is built beside it,
// else the float32 path. What the matrix-vector kernels multiply.
template <class D>
__device__ __forceinline__ void chunk8_f16_at(const uint8_t* src, long long c, unsigned (&out)[4],
                                              const shared_of<D>& tables) {
    const long long v = 8 * c;  // a 1-value type's chunk: 8 blocks from the first, i = 0
    const uint8_t* b = src + (D::block_values == 1 ? v : v / D::block_values) * D::block_bytes;
    const int i = D::block_values == 1 ? 0 : (int)(v % D::block_values);
    if (!chunk8_h2_hook<D>(b, i, out, tables, 0)) chunk8_f16_float<D>(src, c, out);
}
#endif  // STRATA_GGML_HOST

}  // namespace ggml
