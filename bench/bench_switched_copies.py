"""What a routed walk's switched copies cost on the GPU (runtime/conditional.py).

One layer's non-resident experts (N copies of S bytes from pinned host memory into distinct
device slots), captured three ways and replayed:
- `plain`: the copies back to back (the walk's copy stream);
- `switched x`: each copy in a conditional node, a share x of them switched on by the
  route_copies kernel from expert bounds (1.0, 0.5, 0.25, 0.0);
- `layers`: LAYERS such layers in one graph (instantiation time, and the cost per switched-off
  node, which a routed walk pays for every unrouted expert);
- each of those with a layer's copies split into --branches parallel chains (forked from the
  stream after the switching kernel, joined after the copies): whether switched-off nodes and
  small copies overlap when they need not wait for each other.
Prints GB/s of the bytes actually copied and us per node; checks that exactly the switched-on
copies landed.

    python bench/bench_switched_copies.py [--experts 96] [--bytes 1835008] [--layers 48] \
        [--branches 1,2,4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata_rt.backends.cuda.experts.routed_walk import RoutedWalkCopies  # noqa: E402
from strata_rt.runtime import Runtime  # noqa: E402
from strata_rt.schedule.plan import Copy, RouteCopies  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=96, help="copies a layer")
    ap.add_argument("--bytes", type=int, default=1_835_008, help="bytes a copy (a 30B expert)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--branches", type=lambda v: [int(x) for x in v.split(",")],
                    default=[1, 2, 4], help="parallel chains of a layer's switched copies to "
                    "time (comma-separated, 1..8)")
    args = ap.parse_args()
    n, size = args.experts, args.bytes
    rng = np.random.default_rng(0)
    with Runtime.open() as rt:
        host = rt.pinned({"src": n * size})
        src = host.view("src", np.uint8)
        src[:] = rng.integers(0, 256, n * size, dtype=np.uint8)
        dst = rt.alloc(n * size)
        stream = rt.stream("bench")
        n_experts = n
        bounds = rt.alloc(4 * (n_experts + 1) * args.layers)
        start, stop = rt.event("start", timing=True), rt.event("stop", timing=True)

        def timed(graph, reps: int) -> float:
            graph.launch(stream)
            stream.synchronize()
            start.record(stream)
            for _ in range(reps):
                graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            return start.elapsed_ms(stop) / reps

        with rt.capture(stream) as plain:
            for k in range(n):
                rt.memcpy_htod(dst.ptr + k * size, src[k * size:(k + 1) * size], stream)
        ms = timed(plain, args.reps)
        print(f"plain: {n} x {size} B in {ms:.3f} ms, {n * size / ms / 1e6:.1f} GB/s")

        branch_streams = [stream] + [rt.stream(f"branch{b}") for b in range(1, 8)]

        def switched(layers: int, branches: int = 1):
            """Each layer: the switching kernel, then its n switched copies split into
            `branches` chains forked from the stream after the kernel and joined after them."""
            copies = RoutedWalkCopies(rt, rt.stream("side"))
            ops: list = []
            for layer in range(layers):
                first = layer * n
                ops.append(RouteCopies(layer, tuple((first + e, e) for e in range(n))))
                ops += [Copy(first + e, layer, e, e, routed=True) for e in range(n)]
            copies.prepare(ops)
            chains = branch_streams[:branches]
            t0 = time.perf_counter()
            with rt.capture(stream) as graph:
                for op in ops:
                    if isinstance(op, RouteCopies):
                        if op.layer:
                            join(chains)
                        copies.route(op, stream, bounds.ptr + 4 * (n_experts + 1) * op.layer)
                        fork = rt.event("fork")
                        fork.record(stream)
                        for s in chains[1:]:
                            s.wait(fork)
                    else:
                        e = op.expert
                        copies.copy(op, chains[e * branches // n], dst.ptr + e * size,
                                    src.ctypes.data + e * size, size)
                join(chains)
            copies.finish(graph, stream)
            return graph, time.perf_counter() - t0

        def join(chains) -> None:
            for s in chains[1:]:
                done = rt.event("join")
                done.record(s)
                stream.wait(done)

        def set_bounds(on: np.ndarray) -> None:
            b = np.zeros((args.layers, n_experts + 1), np.int32)
            b[:, 1:] = np.cumsum(on.reshape(args.layers, n_experts), axis=1)
            rt.memcpy_htod(bounds.ptr, b, stream)

        def check_switched(one, branches: int) -> None:
            for share in (1.0, 0.5, 0.25, 0.0):
                on = (rng.random(n * args.layers) < share).astype(np.int32)
                set_bounds(on)
                rt.memset_d8(dst.ptr, 0xFF, n * size, stream)
                ms = timed(one, args.reps)
                got = np.empty(n * size, np.uint8)
                rt.memcpy_dtoh(got, dst.ptr, stream)
                stream.synchronize()
                got = got.reshape(n, size)
                lit = on[:n] > 0
                right = (np.array_equal(got[lit], src.reshape(n, size)[lit])
                         and bool((got[~lit] == 0xFF).all()))
                moved = int(lit.sum()) * size
                rate = f"{moved / ms / 1e6:.1f} GB/s of the copied bytes" if moved else ""
                print(f"switched {share:.2f}, {branches} chain(s): {lit.sum()} of {n} copies in "
                      f"{ms:.3f} ms {rate} ({'right' if right else 'WRONG'})")

        for branches in args.branches:
            one, _ = switched(1, branches)
            check_switched(one, branches)
        for branches in (1, max(args.branches)):
            many, took = switched(args.layers, branches)
            print(f"{args.layers} layers x {n} switched copies, {branches} chain(s): captured "
                  f"and instantiated in {took:.2f} s")
            for share in (0.0, 0.45):
                on = (rng.random(n * args.layers) < share).astype(np.int32)
                set_bounds(on)
                ms = timed(many, max(2, args.reps // 5))
                moved = int(on.sum()) * size
                print(f"  {share:.2f} on: {ms:.3f} ms, "
                      f"{moved / ms / 1e6 if moved else 0:.1f} GB/s, "
                      f"{ms * 1e3 / (n * args.layers):.2f} us a node")


if __name__ == "__main__":
    main()
