// One decoder per GGML type: ggml::Decode<T>::pair(block, i) returns values i and i + 1 (i even)
// of the block at `block` as float32, equal bit for bit to gguf.quants.dequantize's output.
// Rounding to fp16 (round to nearest even) is the caller's step. The decoders are
// __host__ __device__: the CPU test compiles them as host code and compares every type with
// the gguf package; the dequantizing gather (gather.cu) runs the same code on the device.
//
// Sources: traits.cuh (name, id, values and bytes per block: generated from
// strata_rt/formats/ggml_types.py), tables.cuh (the grids and level tables: generated from the gguf
// package), decode_common.cuh (arithmetic that never fuses, loads, fp16), then one file per
// family (decode_legacy.cuh, decode_k.cuh, decode_iq.cuh).
#pragma once

#include "decode_common.cuh"
#include "tables.cuh"
#include "traits.cuh"

namespace ggml {

// Decode<T> derives from Traits<T> and has `static Pair pair(const uint8_t* block, int i)`
template <Type T> struct Decode;

}  // namespace ggml

#include "decode_legacy.cuh"
#include "decode_k.cuh"
#include "decode_iq.cuh"

namespace ggml {

// Values v and v + 1 (v even) of a run of blocks stored one after the other from `src` (a
// tensor's rows, which follow each other): block v / values at in-block index v % values.
// A 1-value type's pair spans two consecutive blocks; the decoder reads both.
template <Type T> GGML_HD Pair pair_at(const uint8_t* src, long long v) {
    using D = Decode<T>;
    if (D::block_values == 1) return D::pair(src + v * D::block_bytes, 0);
    return D::pair(src + (v / D::block_values) * D::block_bytes, (int)(v % D::block_values));
}

// Values 8c .. 8c + 7 of a run of blocks as four pairs: what one gather thread writes (one
// 16-byte store). Every block holds 1 or a multiple of 8 values, so the 8 share one block (or
// are 8 consecutive 1-value blocks) and the block is addressed once.
template <Type T> GGML_HD void chunk8_at(const uint8_t* src, long long c, Pair (&out)[4]) {
    using D = Decode<T>;
    static_assert(D::block_values == 1 || D::block_values % 8 == 0, "8 values per block");
    if (D::block_values == 1) {
        const uint8_t* b = src + 8 * c * D::block_bytes;
GGML_UNROLL
        for (int p = 0; p < 4; ++p) out[p] = D::pair(b + 2 * p * D::block_bytes, 0);
    } else {
        const long long v = 8 * c;
        const uint8_t* b = src + (v / D::block_values) * D::block_bytes;
        const int i = (int)(v % D::block_values);
GGML_UNROLL
        for (int p = 0; p < 4; ++p) out[p] = D::pair(b, i + 2 * p);
    }
}

}  // namespace ggml
