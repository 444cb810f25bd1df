// Overlapped launches (programmatic dependent launch, sm_90 and later): a kernel whose launcher
// asks for overlap (strata_rt/runtime/module.py, `overlap=True`) may be started by the GPU while
// the grid before it on the stream is still finishing, so its blocks are resident and its
// parameters loaded when that grid ends instead of after a full launch gap. Such a kernel calls
// wait_prior_grid() first, before it reads or writes any global memory: the call returns once
// the grid before it has completed and its writes are visible, which is the ordering an
// ordinary launch gives. It then lets the grid after it start the same way. Elsewhere (an
// ordinary launch, or a device before sm_90) the call does nothing.
#pragma once

__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
