// The pieces the exact top-k (routing_exact.cu) and the re-ranking (routing_rerank.cu) share:
// the record of a token the bound could not settle, the warp's ordered pick, and the float32
// softmax weights of the picks.
#pragma once

#define ROUTE_TILE 32

// A token the top-k kernel could not settle, for route_rerank: kth is its k-th approximate
// logit and gap = 2 B(t) rounded up; the candidates are the experts whose approximate logit is
// >= kth - gap (every expert when `all` is set).
struct Rerank {
    int token;
    int all;
    float kth;
    float gap;
};

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long u = __shfl_xor_sync(0xffffffffu, v, o);
        v = u > v ? u : v;
    }
    return v;
}

// Picks `picks` entries by descending key, ties to the lower id; lane j < picks gets pick j's id
// and key. Entry i of lane l is expert l + 32 i with key[i]; key 0 marks an entry that is not
// there. Each lane first sorts its entries (an odd-even transposition network: it swaps only
// out-of-order neighbours, so equal keys keep their rising ids), then every pick takes the
// largest head across the warp and the winning lane shifts its list by one: no register array
// is indexed at run time (that would move it to local memory).
template <int NPL, typename Key>
__device__ __forceinline__ void warp_pick(const Key (&key)[NPL], int picks, int lane,
                                          int& my_id, Key& my_key) {
    Key k[NPL];
    int ix[NPL];
#pragma unroll
    for (int i = 0; i < NPL; ++i) {
        k[i] = key[i];
        ix[i] = i;
    }
#pragma unroll
    for (int pass = 0; pass < NPL; ++pass)
#pragma unroll
        for (int i = pass & 1; i + 1 < NPL; i += 2)
            if (k[i] < k[i + 1]) {
                const Key tk = k[i];
                k[i] = k[i + 1];
                k[i + 1] = tk;
                const int ti = ix[i];
                ix[i] = ix[i + 1];
                ix[i + 1] = ti;
            }
    for (int j = 0; j < picks; ++j) {
        Key kmax;
        if constexpr (sizeof(Key) == 8)
            kmax = warp_max_u64(k[0]);
        else
            kmax = __reduce_max_sync(0xffffffffu, k[0]);
        const unsigned mine =
            k[0] != 0 && k[0] == kmax ? (unsigned)(lane + 32 * ix[0]) : 0xffffffffu;
        const unsigned win = __reduce_min_sync(0xffffffffu, mine);
        if (win != 0xffffffffu && (int)(win & 31u) == lane) {
#pragma unroll
            for (int i = 0; i + 1 < NPL; ++i) {
                k[i] = k[i + 1];
                ix[i] = ix[i + 1];
            }
            k[NPL - 1] = 0;
        }
        if (lane == j) {
            my_id = (int)win;
            my_key = kmax;
        }
    }
}

// float32 softmax of v over the experts (lane l sums l, l + 32, ... then an xor tree), taken at
// each lane's pick and renormalised over the k picks in pick order; m is the largest v and
// mine the value of this lane's pick (its v, -0 read as +0).
template <int NPL>
__device__ __forceinline__ float pick_weight_of(const float (&v)[NPL], int n_experts, int top_k,
                                                float m, float mine, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NPL; ++i)
        if (lane + 32 * i < n_experts) s = __fadd_rn(s, expf(v[i] - m));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    const float p = lane < top_k ? __fdiv_rn(expf(mine - m), s) : 0.0f;
    float sum_top = 0.0f;
    for (int j = 0; j < top_k; ++j) sum_top = __fadd_rn(sum_top, __shfl_sync(0xffffffffu, p, j));
    return __fdiv_rn(p, sum_top);
}

// The same, the pick's value fetched from the lane that holds expert my_id.
template <int NPL>
__device__ __forceinline__ float pick_weight(const float (&v)[NPL], int n_experts, int top_k,
                                             float m, int my_id, int lane) {
    float mine = 0.0f;
#pragma unroll
    for (int i = 0; i < NPL; ++i) {
        const float vi = __shfl_sync(0xffffffffu, v[i], my_id & 31);
        if (i == (my_id >> 5)) mine = vi;
    }
    return pick_weight_of<NPL>(v, n_experts, top_k, m, __fadd_rn(mine, 0.0f), lane);
}
