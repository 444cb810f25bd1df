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
#include "decoder.cuh"
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

// The walks of decoder.cuh over a built-in type's blocks (the names the host test uses).
template <Type T> GGML_HD Pair pair_at(const uint8_t* src, long long v) {
    return pair_of<Decode<T>>(src, v);
}

template <Type T> GGML_HD void chunk8_at(const uint8_t* src, long long c, Pair (&out)[4]) {
    chunk8_of<Decode<T>>(src, c, out);
}

}  // namespace ggml
