// The row gather every GGML type shares: rows of a [vocab, cols] matrix picked by int32 ids
// (a whole model's token embedding looked up by token id), decoded to float32. Written once
// against a decoder struct (decoder.cuh), so a type is its decoder and nothing more:
//
//   STRATA_GGML_ROWS(SUFFIX, DEC)   ggml_rows_SUFFIX: the row gather for decoder DEC
//
// Why float32 and not fp16 as the gather of templates.cuh writes: the rows become the chunk's
// residual stream, which the engine keeps in float32, and the host path it replaces uploaded
// gguf.quants.dequantize's float32 rows. Each value is the decoder's float32 value, which equals
// gguf.quants.dequantize bit for bit, so the device rows are the bytes the host path uploaded.
//
// Layout: the matrix is whole blocks of DEC, row after row (row_bytes each), read a byte at a
// time (any alignment: the file's bytes as they are); out is float32 [n_ids, cols], 16-byte
// aligned, cols a multiple of 8. Each thread writes 8 values of one row (two 16-byte stores) per
// step. An id outside 0 .. vocab - 1 reads nothing and gives a row of NaN: the host refuses
// such ids before they are uploaded, and this keeps a stray one from reading past the matrix
// (a NaN row is then refused by the RMSNorm's finiteness flag, never used as a value).
//
// Compiled with -DSTRATA_GGML_HOST only the walk `row_chunk8` is defined, as host code: the CPU
// test runs it through kernels/ggml/host_decode.cu against the gguf package.
#pragma once

#include <stdint.h>

#include "decoder.cuh"

namespace ggml {

// Values 8c .. 8c + 7 of row `id` of the matrix at `table` as four pairs, or NaN for an id
// outside the matrix.
template <class D>
GGML_HD void row_chunk8(const uint8_t* table, long long row_bytes, int vocab, int id,
                        long long c, Pair (&out)[4]) {
    if (id < 0 || id >= vocab) {
        const float nan = bits_to_f32(0x7fc00000u);
GGML_UNROLL
        for (int p = 0; p < 4; ++p) out[p] = {nan, nan};
        return;
    }
    chunk8_of<D>(table + (long long)id * row_bytes, c, out);
}

}  // namespace ggml

#ifndef STRATA_GGML_HOST

namespace ggml {

template <class D>
__device__ __forceinline__ void rows_run(const uint8_t* __restrict__ table,
                                         const int* __restrict__ ids, float* __restrict__ out,
                                         int n_ids, int vocab, long long row_bytes, int cols) {
    const long long per_row = cols / 8;
    const long long chunks = (long long)n_ids * per_row;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < chunks; k += step) {
        const long long r = k / per_row;
        const long long c = k - r * per_row;
        Pair v[4];
        row_chunk8<D>(table, row_bytes, vocab, ids[r], c, v);
        float4* o = reinterpret_cast<float4*>(out + r * cols + 8 * c);
        o[0] = make_float4(v[0].x, v[0].y, v[1].x, v[1].y);
        o[1] = make_float4(v[2].x, v[2].y, v[3].x, v[3].y);
    }
}

}  // namespace ggml

// table: the matrix's blocks; ids: n_ids int32 row ids; out: float32 [n_ids, cols];
// row_bytes: bytes of one row (cols / block values blocks)
#define STRATA_GGML_ROWS(SUFFIX, DEC) STRATA_GGML_ROWS_(SUFFIX, DEC)
#define STRATA_GGML_ROWS_(SUFFIX, DEC)                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                       \
    ggml_rows_##SUFFIX(const uint8_t* __restrict__ table, const int* __restrict__ ids,      \
                       float* __restrict__ out, int n_ids, int vocab, long long row_bytes,   \
                       int cols) {                                                           \
        ggml::rows_run<DEC>(table, ids, out, n_ids, vocab, row_bytes, cols);                \
    }

#endif  // STRATA_GGML_HOST
