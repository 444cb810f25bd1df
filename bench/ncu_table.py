"""Per-kernel time of a profiled run from Nsight Compute's CSV: which kernels a decode step's
time goes to, grouped by name, as one table.

    ncu --profile-from-start off --cache-control none --clock-control none \\
        --metrics gpu__time_duration.sum --csv --log-file step.csv \\
        python bench/bench_decode.py --steps 2 --warmups 1 --paths gemv --regimes all \\
        --profile --out ''
    python bench/ncu_table.py step.csv --per 2 [--layers 48]

`--per N` divides the totals by N (the profiled steps; the last line says "a step"), `--layers L` adds each kernel's time
per layer. Without --cache-control none and --clock-control none, ncu flushes the caches and
locks base clocks before each kernel, which inflates small kernels (bench/notes.md W51, W59).
Each kernel is timed alone (ncu serialises them), so the sum is not a graph step's wall time:
what overlapped launches hide between kernels shows as the difference to bench_decode's step.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import defaultdict
from pathlib import Path

#: microseconds per unit ncu reports gpu__time_duration in
UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def kernel_times(text: str) -> dict[str, list[float]]:
    """Kernel name -> its launches' durations in microseconds, from ncu's --csv output
    (lines ncu prints around the table, starting "==", are skipped)."""
    rows = [line for line in text.splitlines() if line and not line.startswith("==")]
    out: dict[str, list[float]] = defaultdict(list)
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row["Metric Unit"]
        if unit not in UNITS:
            raise ValueError(f"gpu__time_duration in {unit!r}, not one of {sorted(UNITS)}")
        name = row["Kernel Name"].split("(")[0].strip()
        out[name].append(float(row["Metric Value"].replace(",", "")) * UNITS[unit])
    return dict(out)


def table(times: dict[str, list[float]], per: int = 1, layers: int | None = None) -> str:
    """A markdown table, largest total first: launches, total us, mean us, share (and us a
    layer), all divided by `per`."""
    total = sum(sum(v) for v in times.values())
    head = ["kernel", "launches", "us", "mean us", "share"] + (["us a layer"] if layers else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        cells = [name, f"{len(v) / per:g}", f"{sum(v) / per:,.1f}", f"{sum(v) / len(v):,.2f}",
                 f"{100 * sum(v) / total:.1f}%"]
        if layers:
            cells.append(f"{sum(v) / per / layers:,.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{sum(len(v) for v in times.values()) / per:g} launches, "
                 f"{total / per / 1e3:,.3f} ms of kernels{' a step' if per > 1 else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path, help="ncu --csv --log-file output")
    ap.add_argument("--per", type=int, default=1, help="divide by this many steps (default 1)")
    ap.add_argument("--layers", type=int, default=None, help="add each kernel's us a layer")
    args = ap.parse_args(argv)
    if args.per < 1 or (args.layers is not None and args.layers < 1):
        ap.error("--per and --layers must be >= 1")
    times = kernel_times(args.csv.read_text())
    if not times:
        print(f"{args.csv}: no gpu__time_duration.sum rows", file=sys.stderr)
        return 1
    print(table(times, args.per, args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
