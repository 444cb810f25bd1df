// The next token drawn from one row of logits on the device, so that only its id has to reach
// the host (strata_rt/backends/cuda/sampling_kernels.py launches it). It is the numpy sampler
// of strata_rt/text/sampling.py step for step and bit for bit: repetition penalty, temperature,
// top-k, top-p, min-p and the draw, with the random number a function of (seed, step)
// (strata_rt/text/sampling_math.py). Every float operation carries an explicit rounding
// intrinsic, which nvcc never contracts into an FMA, so no step is left to a tolerance.
//
// One block of SAMPLE_THREADS threads:
//   1. radix select (4 passes of 8 bits over every logit) finds the key of the k-th best
//      value; NaN and +inf are flagged in the first pass;
//   2. the values above it, and the first of those equal to it by id, fill the candidates as
//      64-bit keys (value key << 32 | ~id): unique, so any sort gives one order;
//   3. a bitonic sort of the SAMPLE_CAP candidates, best first;
//   4. weights exp(v - v_best) in float64, a Hillis-Steele prefix sum, the top-p and min-p cuts
//      and the draw.
// Shared memory is dynamic (the penalty's bitmap grows with the vocabulary): the candidates,
// then a region the float64 sums reuse once the bitmap, histogram and scan are done with.
#include <stdint.h>

#include "common/prior_grid.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_CAP 2048
#define SAMPLE_FLT_MAX 3.402823466e+38f
// what *out holds when no token can be drawn
#define SAMPLE_BAD_LOGITS -1  // NaN or +inf in the logits
#define SAMPLE_ALL_MASKED -2  // every logit -inf

__device__ __forceinline__ uint64_t sample_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// uniform(seed, step) of sampling_math.py: the top 53 bits of the mixed counter times 2**-53
__device__ __forceinline__ double sample_uniform(uint64_t seed, int step) {
    const uint64_t z = sample_mix64(sample_mix64(seed) + (uint64_t)(step + 1) * 0x9E3779B97F4A7C15ull);
    return __dmul_rn((double)(z >> 11), 0x1.0p-53);
}

// exp_nonpositive of sampling_math.py: exp(x) for x <= 0, 0 below -700
__device__ __forceinline__ double sample_exp(double x) {
    if (!(x >= -700.0)) return 0.0;
    const double k = rint(__dmul_rn(x, 0x1.71547652b82fep+0));
    const double r = __dsub_rn(__dsub_rn(x, __dmul_rn(k, 0x1.62e42fee00000p-1)),
                               __dmul_rn(k, 0x1.a39ef35793c76p-33));
    const double c[13] = {0x1.6124613a86d09p-33, 0x1.1eed8eff8d898p-29, 0x1.ae64567f544e4p-26,
                          0x1.27e4fb7789f5cp-22, 0x1.71de3a556c734p-19, 0x1.a01a01a01a01ap-16,
                          0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10, 0x1.1111111111111p-7,
                          0x1.5555555555555p-5,  0x1.5555555555555p-3,  0x1.0000000000000p-1,
                          0x1.0000000000000p+0};
    double p = c[0];
#pragma unroll
    for (int i = 1; i < 13; ++i) p = __dadd_rn(__dmul_rn(p, r), c[i]);
    p = __dadd_rn(__dmul_rn(p, r), 1.0);
    return __dmul_rn(p, __longlong_as_double((long long)((int)k + 1023) << 52));
}

__device__ __forceinline__ float sample_saturate(float v) {
    return fminf(fmaxf(v, -SAMPLE_FLT_MAX), SAMPLE_FLT_MAX);
}

// adjusted() of sampling.py for one logit: the penalty when `penalised`, the temperature,
// every zero +0; a -inf stays -inf, a finite value stays finite
__device__ __forceinline__ float sample_value(float l, bool penalised, float penalty,
                                              float temperature) {
    const bool finite = isfinite(l);
    if (penalised && finite)
        l = sample_saturate(l > 0.0f ? __fdiv_rn(l, penalty)
                                     : (l < 0.0f ? __fmul_rn(l, penalty) : l));
    if (temperature != 1.0f && finite) l = sample_saturate(__fdiv_rn(l, temperature));
    return __fadd_rn(l, 0.0f);
}

__device__ __forceinline__ uint32_t sample_key(float v) {  // ordered_keys of sampling_math.py
    const uint32_t b = __float_as_uint(v);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float sample_key_value(uint32_t k) {
    return __uint_as_float((k >> 31) ? (k ^ 0x80000000u) : ~k);
}

// Inclusive prefix sum of one int per thread over the block (Hillis-Steele, in `scan`).
__device__ int sample_block_scan(int v, int* scan) {
    scan[threadIdx.x] = v;
    __syncthreads();
    for (int d = 1; d < SAMPLE_THREADS; d <<= 1) {
        const int add = threadIdx.x >= d ? scan[threadIdx.x - d] : 0;
        __syncthreads();
        scan[threadIdx.x] += add;
        __syncthreads();
    }
    return scan[threadIdx.x];
}

// Bytes of dynamic shared memory for `vocab` ids (sampling_kernels.shared_bytes mirrors it).
__host__ __device__ __forceinline__ size_t sample_bitmap_words(int vocab) {
    return ((size_t)vocab + 31) / 32;
}

// out[0] = the id drawn from logits[0..vocab) (not modified), or SAMPLE_BAD_LOGITS /
// SAMPLE_ALL_MASKED. seen: n_seen distinct ids in 0..vocab-1 that take the penalty. k: the
// candidates (1..SAMPLE_CAP, <= vocab); temperature 1 divides by nothing.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_logits(const float* __restrict__ logits, int vocab, const int* __restrict__ seen,
              int n_seen, float penalty, float temperature, int k, double top_p,
              double min_p, long long seed, int step, int* __restrict__ out) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint64_t* cand = reinterpret_cast<uint64_t*>(smem);
    unsigned char* region = smem + SAMPLE_CAP * sizeof(uint64_t);
    double* sums = reinterpret_cast<double*>(region);  // step 4 only
    unsigned* hist = reinterpret_cast<unsigned*>(region);
    int* scan = reinterpret_cast<int*>(region + 256 * sizeof(unsigned));
    uint32_t* bitmap = reinterpret_cast<uint32_t*>(region + 256 * sizeof(unsigned) +
                                                   SAMPLE_THREADS * sizeof(int));
    __shared__ uint32_t prefix, mask;
    __shared__ int remaining, bad, n_greater, cut_p, cut_m, chosen;
    const int tid = threadIdx.x;
    const size_t words = sample_bitmap_words(vocab);
    const bool penalty_on = penalty != 1.0f;

    for (size_t w = tid; w < words; w += SAMPLE_THREADS) bitmap[w] = 0u;
    if (tid == 0) {
        prefix = 0u;
        mask = 0u;
        remaining = k;
        bad = 0;
        n_greater = 0;
        cut_p = k;
        cut_m = k;
        chosen = SAMPLE_CAP;
    }
    __syncthreads();
    if (penalty_on)
        for (int j = tid; j < n_seen; j += SAMPLE_THREADS)
            atomicOr(&bitmap[seen[j] >> 5], 1u << (seen[j] & 31));
    __syncthreads();
#define SAMPLE_VALUE(i) sample_value(logits[i], penalty_on && ((bitmap[(i) >> 5] >> ((i) & 31)) & 1u), penalty, temperature)

    // 1. radix select of the k-th largest key, 8 bits a pass from the top
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = tid; d < 256; d += SAMPLE_THREADS) hist[d] = 0u;
        __syncthreads();
        const uint32_t pre = prefix, msk = mask;
        for (int i = tid; i < vocab; i += SAMPLE_THREADS) {
            if (shift == 24) {
                const float l = logits[i];
                if (isnan(l) || (isinf(l) && l > 0.0f)) bad = 1;
            }
            const uint32_t key = sample_key(SAMPLE_VALUE(i));
            if ((key & msk) == pre) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            int need = remaining;
            for (int d = 255; d >= 0; --d) {
                if (need <= (int)hist[d]) {
                    prefix = pre | ((uint32_t)d << shift);
                    break;
                }
                need -= (int)hist[d];
            }
            remaining = need;
            mask = msk | (255u << shift);
        }
        __syncthreads();
    }
    if (bad) {
        if (tid == 0) out[0] = SAMPLE_BAD_LOGITS;
        return;
    }

    // 2. the candidates: keys above the threshold (in any slot), then the `remaining` keys
    // equal to it with the lowest ids, in id order (each thread scans a contiguous range)
    const uint32_t threshold = prefix;
    const int need_equal = remaining, n_above = k - remaining;
    const int span = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int lo = min(vocab, tid * span), hi = min(vocab, lo + span);
    int equal = 0;
    for (int i = lo; i < hi; ++i) {
        const uint32_t key = sample_key(SAMPLE_VALUE(i));
        if (key > threshold)
            cand[atomicAdd(&n_greater, 1)] = ((uint64_t)key << 32) | (0xFFFFFFFFu - (uint32_t)i);
        else if (key == threshold)
            ++equal;
    }
    int rank = sample_block_scan(equal, scan) - equal;
    for (int i = lo; i < hi && rank < need_equal; ++i) {
        const uint32_t key = sample_key(SAMPLE_VALUE(i));
        if (key == threshold) {
            cand[n_above + rank] = ((uint64_t)key << 32) | (0xFFFFFFFFu - (uint32_t)i);
            ++rank;
        }
    }
    for (int i = k + tid; i < SAMPLE_CAP; i += SAMPLE_THREADS) cand[i] = 0ull;
    __syncthreads();
#undef SAMPLE_VALUE

    // 3. bitonic sort, descending
    for (int size = 2; size <= SAMPLE_CAP; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < SAMPLE_CAP; i += SAMPLE_THREADS) {
                const int j = i ^ stride;
                if (j > i) {
                    const uint64_t a = cand[i], b = cand[j];
                    const bool descending = (i & size) == 0;
                    if (descending ? a < b : a > b) {
                        cand[i] = b;
                        cand[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }

    // 4. weights, their prefix sums, the cuts and the draw
    const float best = sample_key_value((uint32_t)(cand[0] >> 32));
    if (isinf(best)) {  // the best is -inf: so is every logit
        if (tid == 0) out[0] = SAMPLE_ALL_MASKED;
        return;
    }
    double w[SAMPLE_CAP / SAMPLE_THREADS];
#pragma unroll
    for (int e = 0; e < SAMPLE_CAP / SAMPLE_THREADS; ++e) {
        const int i = tid + e * SAMPLE_THREADS;
        w[e] = i < k ? sample_exp(__dsub_rn((double)sample_key_value((uint32_t)(cand[i] >> 32)),
                                            (double)best))
                     : 0.0;
        if (i < k && w[e] < min_p) atomicMin(&cut_m, i);
    }
    __syncthreads();  // the histogram, scan and bitmap are done with: `sums` reuses them
#pragma unroll
    for (int e = 0; e < SAMPLE_CAP / SAMPLE_THREADS; ++e) sums[tid + e * SAMPLE_THREADS] = w[e];
    __syncthreads();
    for (int d = 1; d < SAMPLE_CAP; d <<= 1) {
        double add[SAMPLE_CAP / SAMPLE_THREADS];
#pragma unroll
        for (int e = 0; e < SAMPLE_CAP / SAMPLE_THREADS; ++e) {
            const int i = tid + e * SAMPLE_THREADS;
            add[e] = i >= d ? sums[i - d] : 0.0;
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < SAMPLE_CAP / SAMPLE_THREADS; ++e) {
            const int i = tid + e * SAMPLE_THREADS;
            if (i >= d) sums[i] = __dadd_rn(sums[i], add[e]);
        }
        __syncthreads();
    }
    const double limit = __dmul_rn(top_p, sums[k - 1]);
    for (int i = tid; i < k; i += SAMPLE_THREADS)
        if ((i == 0 ? 0.0 : sums[i - 1]) >= limit) atomicMin(&cut_p, i);
    __syncthreads();
    const int n = max(1, min(k, min(cut_p, cut_m)));
    const double target = __dmul_rn(sample_uniform((uint64_t)seed, step), sums[n - 1]);
    for (int i = tid; i < n; i += SAMPLE_THREADS)
        if (sums[i] > target) atomicMin(&chosen, i);
    __syncthreads();
    if (tid == 0) {
        const int at = chosen < n ? chosen : n - 1;
        out[0] = (int)(0xFFFFFFFFu - (uint32_t)(cand[at] & 0xFFFFFFFFull));
    }
}

// ---------------------------------------------------------------------------- greedy
// The greedy token of one row of logits without the row leaving the device: the argmax with
// numpy's tie rule (the lowest id among equal maxima; -0 equals +0, so both are keyed as +0),
// and a flag for any NaN or infinity, which the host refuses as it refuses such logits itself.
// Each thread keeps the best 64-bit key (value key << 32 | ~id: the larger key is the larger
// value, then the lower id) of a grid-stride run, the block folds its keys, and one atomicMax
// per block folds the grid's into best[0]. result: best (uint64) then the flag (uint32), zeroed
// by the launcher before each launch; a finite logit's key is never 0.
#define ARGMAX_THREADS 256

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
logits_argmax(const float* __restrict__ logits, int vocab, unsigned long long* __restrict__ result) {
    wait_prior_grid();
    __shared__ unsigned long long warp_best[ARGMAX_THREADS / 32];
    unsigned long long key = 0ull;
    int nonfinite = 0;
    for (int i = blockIdx.x * ARGMAX_THREADS + threadIdx.x; i < vocab; i += gridDim.x * ARGMAX_THREADS) {
        const float v = logits[i];
        if (!isfinite(v)) {
            nonfinite = 1;
            continue;
        }
        const unsigned long long k =
            ((unsigned long long)sample_key(__fadd_rn(v, 0.0f)) << 32) | (unsigned long long)(~(uint32_t)i);
        key = k > key ? k : key;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = key;
    nonfinite = __syncthreads_or(nonfinite);  // also the barrier after warp_best
    if (threadIdx.x == 0) {
#pragma unroll
        for (int w = 1; w < ARGMAX_THREADS / 32; ++w) key = warp_best[w] > key ? warp_best[w] : key;
        if (key != 0ull) atomicMax(result, key);
        if (nonfinite) atomicOr(reinterpret_cast<unsigned*>(result + 1), 1u);
    }
}
