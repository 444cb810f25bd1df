// Batched dequantizing gather for every GGML type: up to 16 experts' matrices of one type
// become fp16 images [position][row][col] in one launch, grid (blocks, experts). Instantiated
// once per type (ggml_gather_<TYPE>, from traits.cuh's list) from one template over the
// decoders of decode.cuh, so a type is its decoder and nothing more here.
//
// Conventions, as the IQ3_XXS dequantizing gather (kernels/iq3_xxs/dequant.cu) so this can
// replace the per-format gathers: expert y of the batch goes to position first_pos + y, its
// image at dst + (first_pos + y) * image_bytes (16-byte aligned; image_bytes a multiple of 16);
// an expert's matrix is rows * cols values stored as whole blocks, row after row, so block b
// holds the image's values b * values_per_block.. and the image is the blocks decoded in order.
// bounds / first_expert: as gather_batch in kernels/common/gather.cu (a member whose expert
// first_expert + y has no rows in the layer's routing is skipped; null: none is). A member whose
// source address is 0 is skipped too: its image is left as it was.
//
// Values: fp16(round to nearest even) of the float32 value the decoder gives, which equals
// gguf.quants.dequantize bit for bit. Each thread writes 8 values (one 16-byte store) per step,
// so a warp covers 256 consecutive values: one K-quant / i-quant block, 8 of the 32-value ones.
// Sources are read a byte at a time: blocks of 17, 18, 34, ... bytes have no alignment.
#include <cuda_fp16.h>
#include <stdint.h>

#include "decode.cuh"

#define GGML_GATHER_THREADS 256
#define GGML_GATHER_VALUES 8

struct GgmlSrcs16 { const uint8_t* v[16]; };

template <ggml::Type T>
__device__ __forceinline__ void ggml_gather(const GgmlSrcs16& srcs, uint8_t* dst,
                                            long long image_bytes, long long values,
                                            int first_pos, const int* __restrict__ bounds,
                                            int first_expert) {
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
    const long long chunks = values / GGML_GATHER_VALUES;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += step) {
        ggml::Pair v[4];
        ggml::chunk8_at<T>(src, c, v);
        unsigned w[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const __half2 h = __floats2half2_rn(v[p].x, v[p].y);  // value 8c + 2p: low half
            w[p] = *reinterpret_cast<const unsigned*>(&h);
        }
        out[c] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// srcs: each member's blocks (0: skip it); dst: the images' base; image_bytes: bytes from one
// position's image to the next; values: rows * cols of one expert (a multiple of 8)
#define GGML_GATHER_KERNEL(name, id, qk, nbytes)                                              \
    extern "C" __global__ void __launch_bounds__(GGML_GATHER_THREADS)                        \
    ggml_gather_##name(GgmlSrcs16 srcs, uint8_t* dst, long long image_bytes, long long values, \
                       int first_pos, const int* __restrict__ bounds, int first_expert) {      \
        ggml_gather<ggml::Type::name>(srcs, dst, image_bytes, values, first_pos, bounds,      \
                                      first_expert);                                          \
    }
GGML_TYPES(GGML_GATHER_KERNEL)
#undef GGML_GATHER_KERNEL
