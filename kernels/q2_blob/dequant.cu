// Q2 blob dequantizing gather (variant f16_gemm): one expert's planar blob -> fp16 images for
// the grouped fp16 GEMM (one launch per expert; the format is not native).
//
//   gate/up image: fp16 [2f, h], gate rows then up rows (the blob interleaves them: blob row
//                  2k = gate row k, 2k+1 = up row k);
//   down image:    fp16 [h, f].
// Weight = (code - 1) * scale: code is 2 bits (four per byte, low bits first), scale the fp16 of
// its 64-weight group. The product is exact in float32 and each value, one of -s, 0, s, 2s,
// fits fp16 exactly (2s may overflow to infinity, as numpy's cast does), so the images are
// bit for bit the numpy twin's (quants/q2_blob_f16.py), signed zeros included.
//
// blockIdx.y picks the image (0 gate/up, 1 down). A thread takes one 32-bit word of codes (16
// weights of one group) per step and writes 32 bytes. Sources must be 4-byte aligned and the
// images 16-byte aligned (the launcher checks).
#include <cuda_fp16.h>
#include <stdint.h>

extern "C" __global__ void q2_dequant_f16(const uint8_t* __restrict__ blob,
                                          __half* __restrict__ gu, __half* __restrict__ dn,
                                          int hidden, int ffn)
{
    const long long h = hidden, f = ffn;
    const long long gu_codes = 2 * f * h / 4, dn_codes = h * f / 4;
    const __half* gs = reinterpret_cast<const __half*>(blob + gu_codes + dn_codes);
    const bool down = blockIdx.y == 1;
    const long long rows = down ? h : 2 * f, cols = down ? f : h;
    const long long words = cols / 16;  // 32-bit code words per row
    const uint32_t* codes = reinterpret_cast<const uint32_t*>(down ? blob + gu_codes : blob);
    const __half* scales = down ? gs + 2 * f * (h / 64) : gs;
    __half* out = down ? dn : gu;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows * words;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / words, w = i - r * words;
        const long long sr = down ? r : (r < f ? 2 * r : 2 * (r - f) + 1);
        const uint32_t c = codes[sr * words + w];
        const float s = __half2float(scales[sr * (cols / 64) + w / 4]);
        __align__(16) __half v[16];
#pragma unroll
        for (int j = 0; j < 16; ++j)
            v[j] = __float2half_rn((float)((int)((c >> (2 * j)) & 3u) - 1) * s);
        uint4* dst = reinterpret_cast<uint4*>(out + r * cols + w * 16);
        dst[0] = reinterpret_cast<const uint4*>(v)[0];
        dst[1] = reinterpret_cast<const uint4*>(v)[1];
    }
}
