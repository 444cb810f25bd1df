// The row gather for every built-in GGML type: rows of a matrix picked by int32 ids, decoded to
// float32 (a whole model's token embedding looked up on the device). One kernel per type
// (ggml_rows_<TYPE>, from traits.cuh's list), each the shared template of rows.cuh over the
// type's decoder (decode.cuh). Values: the decoder's float32 value, gguf.quants.dequantize's
// bit for bit.
#include "decode.cuh"
#include "rows.cuh"

#define GGML_ROWS_KERNEL(name, id, qk, nbytes) \
    STRATA_GGML_ROWS(name, ggml::Decode<ggml::Type::name>)
GGML_TYPES(GGML_ROWS_KERNEL)
#undef GGML_ROWS_KERNEL
