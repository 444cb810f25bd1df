// The expert product on Hopper tensor cores (wgmma, TMA, warp-specialized persistent blocks),
// built from the CUTLASS headers of the nvidia-cutlass package into a shared library that
// strata_rt.gemm.cutlass_gemm drives through ctypes.
//
//   out[r, i] = sum_k acts[r, k] * W_p[i, k]   for every activation row r of every expert e_p
//
// The contract is gemm_f16.cu's (the FormatKernels.mmq ABI): W_p is the fp16 image at group
// position p (m x k row-major at weights + p*m*k*2 bytes), acts are fp16 [rows, k] sorted by
// expert, bounds[e]..bounds[e+1]-1 are expert e's rows, out is float32 [rows, m] written at the
// same rows; an expert id of -1 is an unused position.
//
// Why a library and not a cubin: a CUTLASS kernel's parameters carry TMA descriptors that the
// host encodes, and its argument structures are C++ templates; a small extern "C" surface keeps
// all of that here. Nothing the host computes depends on the routing: a one-warp prepare kernel
// reads bounds on the device and writes each expert's problem shape and operand addresses into
// a per-stream argument block, and the persistent grouped kernel reads them there. So a launch
// never waits for the host, and a CUDA graph captures both kernels.
//
// Numerics: fp16 x fp16 products accumulated in fp32 over the whole K in ascending k-tile
// order, one block per output tile, no split-K and no atomics; the epilogue stores the
// accumulator (alpha 1, no source). Same bytes run after run.

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace strata {

using namespace cute;

constexpr int kGroup = 16;  // experts per group buffer (MMQ_GROUP)

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // M, N, K
using ElementIn = cutlass::half_t;
using ElementOut = float;
using LayoutA = cutlass::layout::RowMajor;     // activations [rows, k]
using LayoutB = cutlass::layout::ColumnMajor;  // image [m, k] row-major = k x m column-major
using LayoutD = cutlass::layout::RowMajor;     // out [rows, m]
constexpr int kAlignIn = 8;                    // 16 bytes of fp16
constexpr int kAlignOut = 4;                   // 16 bytes of fp32

template <class Tile, class Cluster, class MainSchedule, class EpiSchedule>
struct Config {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignOut, ElementOut, LayoutD*, kAlignOut, EpiSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn,
      ElementIn, LayoutB*, kAlignIn, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using Coop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using PingEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

// The kernels this library holds, in the order of strata_rt.gemm.cutlass_gemm.CUTLASS_TILES.
using Coop128x256 = Config<Shape<_128, _256, _64>, Shape<_1, _1, _1>, Coop, CoopEpi>;
using Ping64x256 = Config<Shape<_64, _256, _64>, Shape<_1, _1, _1>, Ping, PingEpi>;
using Ping64x128 = Config<Shape<_64, _128, _64>, Shape<_1, _1, _1>, Ping, PingEpi>;
using Coop128x128 = Config<Shape<_128, _128, _64>, Shape<_1, _1, _1>, Coop, CoopEpi>;

// Every config shares these stride types (row-major or K-major operands, one batch).
using StrideA = typename Coop128x256::Kernel::InternalStrideA;
using StrideB = typename Coop128x256::Kernel::InternalStrideB;
using StrideD = typename Coop128x256::Kernel::InternalStrideD;

// What the prepare kernel writes for one launch, on the device.
struct GroupArgs {
  ProblemShape::UnderlyingProblemShape shape[kGroup];
  const ElementIn* a[kGroup];
  const ElementIn* b[kGroup];
  ElementOut* d[kGroup];
  StrideA stride_a[kGroup];
  StrideB stride_b[kGroup];
  StrideD stride_d[kGroup];
};

struct ExpertIds {
  int id[kGroup];
};

// One thread per group position: expert e_p's rows bounds[e_p] .. bounds[e_p + 1] - 1, or none.
__global__ void prepare_group(GroupArgs* g, ExpertIds ids, const ElementIn* weights,
                              const ElementIn* acts, const int* bounds, ElementOut* out, int m,
                              int k) {
  const int p = threadIdx.x;
  if (p >= kGroup) return;
  const int e = ids.id[p];
  int r0 = 0, rows = 0;
  if (e >= 0) {
    r0 = bounds[e];
    rows = bounds[e + 1] - r0;
  }
  g->shape[p] = make_shape(rows, m, k);
  g->a[p] = acts + (size_t)r0 * k;
  g->b[p] = weights + (size_t)p * m * k;
  g->d[p] = out + (size_t)r0 * m;
  g->stride_a[p] = cutlass::make_cute_packed_stride(StrideA{}, make_shape(rows, k, 1));
  g->stride_b[p] = cutlass::make_cute_packed_stride(StrideB{}, make_shape(m, k, 1));
  g->stride_d[p] = cutlass::make_cute_packed_stride(StrideD{}, make_shape(rows, m, 1));
}

template <class C>
typename C::Gemm::Arguments arguments(GroupArgs* g, int device, int sm_count) {
  typename C::Gemm::Arguments args;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  decltype(args.epilogue.thread) fusion{};
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  args = typename C::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {kGroup, g ? g->shape : nullptr, nullptr},  // shapes live on the device only
      {g ? g->a : nullptr, g ? g->stride_a : nullptr, g ? g->b : nullptr,
       g ? g->stride_b : nullptr},
      {fusion, nullptr, nullptr, g ? g->d : nullptr, g ? g->stride_d : nullptr},
      hw};
  return args;
}

void set_error(char* err, int len, const char* what, const char* detail) {
  if (err && len > 0) snprintf(err, (size_t)len, "%s: %s", what, detail);
}

// The initialized adapters of one CUDA context. An adapter's parameters (TMA descriptor
// templates, grid) depend only on the argument block and the workspace, so after the first
// launch a launch is prepare_group plus the kernel. A context owns one session: the kernels'
// shared-memory opt-in is per context.
struct Session {
  std::mutex lock;
  int device = 0;
  int sm_count = 0;
  std::map<std::tuple<int, void*, void*>, void*> ready;
  std::map<std::tuple<int, void*, void*>, void (*)(void*)> drop;
};

template <class C>
int launch(Session* ses, int tile, cudaStream_t stream, GroupArgs* g, void* workspace,
           size_t workspace_bytes, char* err, int err_len) {
  using Gemm = typename C::Gemm;
  std::lock_guard<std::mutex> hold(ses->lock);
  auto key = std::make_tuple(tile, (void*)g, workspace);
  auto it = ses->ready.find(key);
  if (it == ses->ready.end()) {
    auto args = arguments<C>(g, ses->device, ses->sm_count);
    size_t need = Gemm::get_workspace_size(args);
    if (need > workspace_bytes) {
      char detail[96];
      snprintf(detail, sizeof detail, "needs %zu bytes, given %zu", need, workspace_bytes);
      set_error(err, err_len, "workspace", detail);
      return 2;
    }
    cutlass::Status s = Gemm::can_implement(args);
    if (s != cutlass::Status::kSuccess) {
      set_error(err, err_len, "can_implement", cutlassGetStatusString(s));
      return 3;
    }
    Gemm* gemm = new Gemm();
    s = gemm->initialize(args, workspace, stream);
    if (s != cutlass::Status::kSuccess) {
      delete gemm;
      set_error(err, err_len, "initialize", cutlassGetStatusString(s));
      return 4;
    }
    it = ses->ready.emplace(key, gemm).first;
    ses->drop.emplace(key, [](void* q) { delete static_cast<Gemm*>(q); });
  }
  cutlass::Status s = static_cast<Gemm*>(it->second)->run(stream);
  if (s != cutlass::Status::kSuccess) {
    set_error(err, err_len, "run", cutlassGetStatusString(s));
    return 5;
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    set_error(err, err_len, "grouped kernel launch", cudaGetErrorString(e));
    return 5;
  }
  return 0;
}

template <class C>
size_t workspace_of(int device, int sm_count) {
  return C::Gemm::get_workspace_size(arguments<C>(nullptr, device, sm_count));
}

}  // namespace strata

using namespace strata;

extern "C" {

// Version of this surface; strata_rt.gemm.cutlass_gemm refuses a library of another.
int strata_cutlass_abi(void) { return 3; }

// Device bytes of one argument block (one per stream that launches).
size_t strata_cutlass_args_bytes(void) { return sizeof(GroupArgs); }

int strata_cutlass_tiles(void) { return 4; }

// A session for the CUDA context current on this thread (its device, sm_count
// multiprocessors); 0 when the device cannot be read.
void* strata_cutlass_open(int sm_count) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return nullptr;
  Session* ses = new Session();
  ses->device = device;
  ses->sm_count = sm_count;
  return ses;
}

void strata_cutlass_close(void* session) {
  Session* ses = static_cast<Session*>(session);
  if (!ses) return;
  for (auto& kv : ses->drop) kv.second(ses->ready[kv.first]);
  delete ses;
}

// Workspace bytes the kernel `tile` asks for in this session.
size_t strata_cutlass_workspace_bytes(void* session, int tile) {
  Session* ses = static_cast<Session*>(session);
  switch (tile) {
    case 0: return workspace_of<Coop128x256>(ses->device, ses->sm_count);
    case 1: return workspace_of<Ping64x256>(ses->device, ses->sm_count);
    case 2: return workspace_of<Ping64x128>(ses->device, ses->sm_count);
    case 3: return workspace_of<Coop128x128>(ses->device, ses->sm_count);
    default: return 0;
  }
}

// Enqueues the grouped product on `stream`: prepare_group, then the grouped kernel `tile`.
// args_block must not be in use by a launch on another stream. Returns 0, or a nonzero code
// with a message in err.
int strata_cutlass_gemm(void* session, int tile, void* stream, const int* expert_ids,
                        const void* weights, const void* acts, const int* bounds, void* out,
                        int m, int k, void* args_block, void* workspace, size_t workspace_bytes,
                        char* err, int err_len) {
  Session* ses = static_cast<Session*>(session);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  ExpertIds ids;
  for (int p = 0; p < kGroup; ++p) ids.id[p] = expert_ids[p];
  GroupArgs* g = static_cast<GroupArgs*>(args_block);
  prepare_group<<<1, 32, 0, s>>>(g, ids, static_cast<const ElementIn*>(weights),
                                 static_cast<const ElementIn*>(acts), bounds,
                                 static_cast<ElementOut*>(out), m, k);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    set_error(err, err_len, "prepare_group", cudaGetErrorString(e));
    return 1;
  }
  switch (tile) {
    case 0:
      return launch<Coop128x256>(ses, 0, s, g, workspace, workspace_bytes, err, err_len);
    case 1:
      return launch<Ping64x256>(ses, 1, s, g, workspace, workspace_bytes, err, err_len);
    case 2:
      return launch<Ping64x128>(ses, 2, s, g, workspace, workspace_bytes, err, err_len);
    case 3:
      return launch<Coop128x128>(ses, 3, s, g, workspace, workspace_bytes, err, err_len);
    default:
      set_error(err, err_len, "tile", "unknown index");
      return 6;
  }
}

}  // extern "C"
