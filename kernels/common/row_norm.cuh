// The RMSNorm of one row as the engine computes it, shared by the kernels that normalise a
// residual row (engine.cu's rmsnorm_rows; routing_rerank.cu's one-token routing, which
// normalises its token in every block): the same code in both, so the same bytes.
#pragma once

// Block-wide sum with a fixed tree, so the result is the same on every run.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? scratch[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    const float total = scratch[0];
    __syncthreads();
    return total;
}

// 1 / sqrt(mean(row^2) + eps) of a row of `hidden` floats: thread t adds the squares of columns
// t, t + blockDim.x, ... (fmaf, ascending), then block_sum. A sum of squares that is not finite
// (the row holds NaN or Inf, or its squares overflow, which would normalise it to zeros) lowers
// *bad to (layer << 32 | row), where `flags` (one block per row reports). scratch: 32 floats.
__device__ __forceinline__ float row_rms_scale(const float* __restrict__ row, int hidden,
                                               float eps, float* scratch,
                                               unsigned long long* __restrict__ bad, int layer,
                                               unsigned row_index, bool flags) {
    float ss = 0.0f;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) ss = fmaf(row[c], row[c], ss);
    ss = block_sum(ss, scratch);
    if (flags && threadIdx.x == 0 && !isfinite(ss))
        atomicMin(bad, ((unsigned long long)layer << 32) | row_index);
    return 1.0f / sqrtf(ss / (float)hidden + eps);
}
