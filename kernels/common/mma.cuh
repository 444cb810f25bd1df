// Thin wrappers over the PTX the MMQ kernels use (tensor-core mma.sync, ldmatrix, cp.async),
// so the kernels read as tile logic. sm_80 and newer. The mma wrappers are plain (not
// volatile) asm: they only read registers, and volatile would pin every mma in source order
// against the shared-memory loads and keep the compiler from interleaving independent work.
#pragma once
#include <stdint.h>

// The experts of one MMQ group, passed by value as 16 int32 kernel parameters (unused = -1),
// so a launch needs no host-to-device copy and can be captured in a CUDA graph.
struct Ids16 { int v[16]; };

// Traps when the launch gave less dynamic shared memory than the kernel uses: a launcher that
// disagrees with its kernel must fail loudly, never write past the allocation.
__device__ __forceinline__ void require_dynamic_smem(unsigned bytes) {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < bytes) __trap();
}

// One block of a grouped GEMM under the MMQ ABI (grid = weight tiles x group positions x row
// tiles). Blocks run in launch order with the row tile fastest, then the weight tile, then the
// group position, so the row tiles sharing a weight tile run together and read it from L2.
// expert: ids.v[pos] (-1: an empty position), found by selects because a dynamic index would
// copy the ids to local memory.
struct GroupedBlock { int row_tile, weight_tile, pos, expert; };

// The block's row tile, weight tile and grid y position (pos), expert unset (-1).
__device__ __forceinline__ GroupedBlock block_order() {
    const unsigned gx = gridDim.x, gz = gridDim.z;
    const unsigned lin = blockIdx.x + gx * (blockIdx.y + gridDim.y * blockIdx.z);
    GroupedBlock b;
    b.row_tile = lin % gz;
    b.weight_tile = (lin / gz) % gx;
    b.pos = lin / (gz * gx);
    b.expert = -1;
    return b;
}

__device__ __forceinline__ GroupedBlock grouped_block(const Ids16& ids) {
    GroupedBlock b = block_order();
#pragma unroll
    for (int i = 0; i < 16; ++i) b.expert = i == b.pos ? ids.v[i] : b.expert;
    return b;
}

// One block of a table product (grid = weight tiles x the layer's experts x row tiles): the
// block order of grouped_block, the expert e = the grid's y position (pos = expert = e).
__device__ __forceinline__ GroupedBlock table_block() {
    GroupedBlock b = block_order();
    b.expert = b.pos;
    return b;
}

// Expert e's image in a table product: its blob address table[e] plus the part's offset, or
// nullptr where table[e] is 0 (the expert is not read here).
__device__ __forceinline__ const uint8_t* table_image(const unsigned long long* table, int e,
                                                      long long offset) {
    const unsigned long long base = table[e];
    return base == 0ull ? nullptr
                        : reinterpret_cast<const uint8_t*>(base + (unsigned long long)offset);
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// Four 8x8 b16 matrices (= 8 rows x 16 bytes each); lane L supplies the row address of
// matrix L/8, row L%8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row_ptr)));
}

// 16-byte shared-memory load kept in program order with ldmatrix (both volatile), so the
// compiler does not hoist a whole unrolled K loop's fragments into registers ahead of use.
__device__ __forceinline__ uint4 lds128(const void* p) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(smem_addr(p)));
    return v;
}

// D = A(16x32 s8, row) * B(32x8 s8, col), fresh int32 accumulator (C = 0).
__device__ __forceinline__ void mma_s8_16x8x32(int (&d)[4], const unsigned (&a)[4], unsigned b0,
                                               unsigned b1) {
    asm(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// D = A(16x16 f16, row) * B(16x8 f16, col) + C, float32 accumulation.
__device__ __forceinline__ void mma_f16_16x8x16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                unsigned b1, const float (&c)[4]) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
}

// 16-byte global->shared copy; src_bytes = 0 fills the destination with zeros (src unread).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// Two int8 values (bytes lo_sel and lo_sel+1 of v, selected as 0x4140 or 0x4342) -> exact
// half2: bias to unsigned, place under the fp16 exponent of 1024, subtract 1024+128.
__device__ __forceinline__ unsigned s8x2_to_half2(unsigned v, unsigned selector) {
    const unsigned biased = __byte_perm(v ^ 0x80808080u, 0x64646464u, selector);
    unsigned r;
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(biased), "r"(0x64806480u));
    return r;
}

__device__ __forceinline__ unsigned hmul2_bits(unsigned a, unsigned b) {
    unsigned r;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
