// The decoders as host code, for the CPU test (tests/test_ggml_decode_host.py): built with nvcc
// into a shared library (host code only; no device is needed) with -ffp-contract=off, loaded
// with ctypes and compared with gguf.quants.dequantize on random and quantized blocks. The
// shared templates' host exports (templates.cuh, STRATA_GGML_HOST) add, per type SUFFIX,
// ggml_host_decode_SUFFIX and ggml_host_fused_SUFFIX (the fused tiles' geometry, which the
// launcher's formula must match), as a plugin's own source built the same way exports them.
// ggml_host_rows walks the row gather of rows.cuh (rows by id, float32) the same way.
#define STRATA_GGML_HOST
#include "decode.cuh"
#include "rows.cuh"
#include "templates.cuh"

#define GGML_HOST_EXPORTS(name, id, qk, nbytes) \
    STRATA_GGML_KERNELS(name, ggml::Decode<ggml::Type::name>)
GGML_TYPES(GGML_HOST_EXPORTS)
#undef GGML_HOST_EXPORTS

namespace {

template <ggml::Type T>
int decode_run(const uint8_t* src, long long nvalues, float* out) {
    for (long long v = 0; v < nvalues; v += 2) {
        const ggml::Pair p = ggml::pair_at<T>(src, v);
        out[v] = p.x;
        out[v + 1] = p.y;
    }
    return 0;
}

template <ggml::Type T>
int decode_chunks(const uint8_t* src, long long nvalues, float* out) {
    for (long long c = 0; c < nvalues / 8; ++c) {
        ggml::Pair p[4];
        ggml::chunk8_at<T>(src, c, p);
        for (int k = 0; k < 4; ++k) {
            out[8 * c + 2 * k] = p[k].x;
            out[8 * c + 2 * k + 1] = p[k].y;
        }
    }
    return 0;
}

template <ggml::Type T>
int rows_run(const uint8_t* table, long long row_bytes, int vocab, const int* ids, int n_ids,
             int cols, float* out) {
    using D = ggml::Decode<T>;
    if (n_ids < 0 || cols <= 0 || cols % 8 || cols % D::block_values ||
        row_bytes != (long long)(cols / D::block_values) * D::block_bytes)
        return -2;
    for (int r = 0; r < n_ids; ++r) {
        for (long long c = 0; c < cols / 8; ++c) {
            ggml::Pair p[4];
            ggml::row_chunk8<D>(table, row_bytes, vocab, ids[r], c, p);
            float* o = out + (long long)r * cols + 8 * c;
            for (int k = 0; k < 4; ++k) {
                o[2 * k] = p[k].x;
                o[2 * k + 1] = p[k].y;
            }
        }
    }
    return 0;
}

}  // namespace

// Decodes nvalues values (even, whole blocks) of type type_id from src into out.
// Returns 0, -1 for a type without a decoder, -2 for a count that is not whole pairs and blocks.
extern "C" int ggml_host_decode(int type_id, const uint8_t* src, long long nvalues, float* out) {
    switch (type_id) {
#define GGML_CASE(name, id, qk, nbytes)                                    \
    case id:                                                               \
        if (nvalues < 0 || nvalues % 2 || nvalues % qk) return -2;         \
        return decode_run<ggml::Type::name>(src, nvalues, out);
        GGML_TYPES(GGML_CASE)
#undef GGML_CASE
    }
    return -1;
}

// As ggml_host_decode through the gather's path (chunk8_at: 8 values per step); nvalues must
// also be a multiple of 8.
extern "C" int ggml_host_decode_chunks(int type_id, const uint8_t* src, long long nvalues,
                                       float* out) {
    switch (type_id) {
#define GGML_CASE(name, id, qk, nbytes)                                            \
    case id:                                                                       \
        if (nvalues < 0 || nvalues % 8 || nvalues % qk) return -2;                 \
        return decode_chunks<ggml::Type::name>(src, nvalues, out);
        GGML_TYPES(GGML_CASE)
#undef GGML_CASE
    }
    return -1;
}

// Rows ids[0..n_ids) of a [vocab, cols] matrix of type type_id (row_bytes per row) into float32
// out [n_ids, cols], as the row gather walks them (rows.cuh: NaN rows for ids outside the
// matrix). Returns 0, -1 for a type without a decoder, -2 for a geometry the gather refuses.
extern "C" int ggml_host_rows(int type_id, const uint8_t* table, long long row_bytes, int vocab,
                              const int* ids, int n_ids, int cols, float* out) {
    switch (type_id) {
#define GGML_CASE(name, id, qk, nbytes) \
    case id:                            \
        return rows_run<ggml::Type::name>(table, row_bytes, vocab, ids, n_ids, cols, out);
        GGML_TYPES(GGML_CASE)
#undef GGML_CASE
    }
    return -1;
}

// The compiled traits, for the test that checks them against the Python table: writes
// (id, values per block, bytes per block) of type k (0-based, traits.cuh order) and returns 0,
// or returns -1 past the last type.
extern "C" int ggml_host_traits(int k, int* id, int* values, int* nbytes) {
    int n = 0;
#define GGML_ROW(name, tid, qk, nb)                                            \
    if (n++ == k) {                                                            \
        using Tr = ggml::Traits<ggml::Type::name>;                             \
        *id = Tr::type_id;                                                     \
        *values = Tr::block_values;                                            \
        *nbytes = Tr::block_bytes;                                             \
        return 0;                                                              \
    }
    GGML_TYPES(GGML_ROW)
#undef GGML_ROW
    return -1;
}
