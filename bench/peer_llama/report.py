"""The tables of one file: time to first token per prompt length in each regime (strata_rt and
llama.cpp side by side), decode tokens/s, and what strata_rt streamed over PCIe.

Ratios say how many times faster strata_rt is: llama.cpp ms / strata_rt ms for prefill,
strata_rt tokens/s / llama.cpp tokens/s for decode (> 1: strata_rt faster).
"""

from __future__ import annotations

from typing import Any

from strata_rt.cli.common import markdown_table

#: (strata_rt column, llama.cpp column) per regime; {ncmoe} is the layers llama.cpp keeps in
#: host memory
LABELS = {"quarter": ("strata, 1/4 experts resident", "llama.cpp --n-cpu-moe {ncmoe}"),
          "all": ("strata, all resident", "llama.cpp, all on GPU")}
DECODE_LABELS = {"quarter": "1/4 experts resident / --n-cpu-moe {ncmoe}",
                 "all": "all resident / all on GPU"}


def _short(error: str, n: int = 40) -> str:
    text = " ".join(str(error).split()).replace("|", "/")
    return text if len(text) <= n else text[: n - 3] + "..."


def ms_cell(rec: dict[str, Any] | None, error: str | None = None) -> str:
    """A time cell: ms, `failed: why`, or `-` (not run)."""
    if rec is not None and rec.get("ms") is not None:
        ub = rec.get("n_ubatch")
        return f"{rec['ms']:,.1f}" + (f" (ub {ub})" if ub else "")
    why = (rec or {}).get("error") or error
    return f"failed: {_short(why)}" if why else "-"


def size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def ratio(num: float | None, den: float | None) -> str:
    if not num or not den:
        return "-"
    return f"{num / den:.2f}x"


def strata_by_tokens(strata: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    return {int(r["tokens"]): r for r in (strata or {}).get("prompts", [])}


def prefill_table(regimes: dict[str, dict[str, Any]], ncmoe: int) -> str:
    """| tokens | strata | llama.cpp | ratio | ... | for the regimes run (quarter, then all).

    regimes[name] = {"prompts": [...], "strata": child results or None, "llama": {"prefill":
    {tokens: {ms, n_ubatch, ...}}, "errors": {tokens: why}} or None}."""
    names = [r for r in LABELS if r in regimes]
    headers = ["tokens"]
    for r in names:
        s, q = LABELS[r]
        headers += [s, q.format(ncmoe=ncmoe), "ratio"]
    tokens = sorted({n for r in names for n in regimes[r]["prompts"]})
    rows = []
    for n in tokens:
        row: list[str] = [f"{n:,}"]
        for r in names:
            reg = regimes[r]
            if n not in reg["prompts"]:
                row += ["-", "-", "-"]
                continue
            strata = reg.get("strata")
            s_rec = strata_by_tokens(strata).get(n)
            s_err = None if strata is None else strata.get("error")
            llama = reg.get("llama")
            q_rec = None if llama is None else llama["prefill"].get(n)
            q_err = None if llama is None else llama["errors"].get(n)
            row += [ms_cell(s_rec, s_err), ms_cell(q_rec, q_err),
                    ratio(None if q_rec is None else q_rec.get("ms"),
                          None if s_rec is None else s_rec.get("ms"))]
        rows.append(row)
    return markdown_table(headers, rows)


def decode_table(regimes: dict[str, dict[str, Any]], ncmoe: int) -> str:
    rows = []
    for r in (r for r in DECODE_LABELS if r in regimes):
        reg = regimes[r]
        strata, llama = reg.get("strata"), reg.get("llama")
        dec = (strata or {}).get("decode") or {}
        s_tps = dec.get("tokens_per_s")
        s_cell = f"{s_tps:,.1f}" if s_tps else (
            "-" if strata is None else f"failed: {_short(dec.get('error') or strata.get('error') or 'no result')}")
        q_tps = None if llama is None else llama.get("decode")
        q_cell = f"{q_tps:,.1f}" if q_tps else (
            "-" if llama is None else f"failed: {_short(llama.get('decode_error') or 'no result')}")
        rows.append([DECODE_LABELS[r].format(ncmoe=ncmoe), s_cell, q_cell, ratio(s_tps, q_tps)])
    return markdown_table(["regime", "strata tok/s", "llama.cpp tok/s", "ratio"], rows)


def pcie_table(strata: dict[str, Any] | None) -> str | None:
    """What strata_rt streamed per prompt in one regime, and its share of the PCIe floor."""
    recs = [r for r in (strata or {}).get("prompts", []) if r.get("ms") is not None]
    if not recs:
        return None
    rows = [[f"{r['tokens']:,}", f"{r['bytes_streamed'] / 2**20:,.1f}",
             f"{r['experts_streamed']:,}", f"{r['pcie_gb_s']:,.1f}",
             "-" if r.get("floor_ms") is None else f"{r['floor_ms']:,.1f}",
             "-" if r.get("pcie_share") is None else f"{r['pcie_share']:.0%}"] for r in recs]
    return markdown_table(["tokens", "streamed MiB", "experts streamed", "PCIe GB/s",
                           "PCIe floor ms", "PCIe share"], rows)


def markdown(doc: dict[str, Any]) -> str:
    """The .md of one file's results (doc as bench_peer_llama writes its JSON)."""
    regimes, ncmoe = doc["regimes"], doc["n_cpu_moe"]
    parts = [f"# strata_rt and llama.cpp on {doc['file']['name']}", "",
             doc["hardware"], "", f"`{doc['command']}`", "",
             f"File: {doc['file']['name']}, {size(doc['file']['bytes'])} "
             f"({doc['file']['mix']}); {doc['file']['description']}", "",
             "Time to first token, ms (ratio: llama.cpp ms / strata ms, > 1: strata faster; "
             "llama.cpp's best micro-batch in brackets):", "",
             prefill_table(regimes, ncmoe)]
    if doc.get("decode_steps", 1):  # --decode-steps 0: no decode ran, so no table of failures
        parts += ["", "Decode (ratio: strata tok/s / llama.cpp tok/s):", "",
                  decode_table(regimes, ncmoe)]
    quarter = regimes.get("quarter", {}).get("strata")
    pcie = pcie_table(quarter)
    if pcie:
        ceiling = (quarter or {}).get("h2d_gb_s")
        parts += ["", "strata, 1/4 experts resident: experts streamed over PCIe (floor = bytes / "
                  "pinned H2D ceiling " + ("n/a" if not ceiling else f"{ceiling:.1f} GB/s")
                  + "; share = floor / time):", "", pcie]
    parts += ["", "Commands:", ""]
    parts += [f"- `{c}`" for c in doc["llama_commands"]]
    parts += [f"- strata_rt {r}: config {doc['strata_configs'][r]}"
              for r in doc.get("strata_configs", {})]
    if doc.get("notes"):
        parts += ["", "Notes:", ""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(parts) + "\n"
