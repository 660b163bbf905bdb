"""The result file's tables, in markdown ready for BENCHMARKS.md, and the features this run could not measure.

Every figure comes from the result dict bench/multigpu/__main__.py writes (one JSON file per device kind); SGLang's
published anchors stand beside ours in a column marked "not comparable" (other model, other hardware): they say
what a figure is judged against, not that the two were measured alike.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

# The published anchors (SGLang), each with the condition it was measured in.
CAPTURE_ANCHOR = "synchronous capture ~13% of a decode step before it was deferred"
TBO_ANCHOR = "two-batch overlap loses 27% at 32 tokens per device (96 H100s)"
SBO_ANCHOR = "single-batch overlap +6% at batch 32 (H20)"
NOT_COMPARABLE = "not comparable: other model and hardware"


def features(engine_options: frozenset[str], mtp_refusal: str | None) -> list[dict[str, str]]:
    """What the issue also asks to measure and this engine cannot yet: two-batch overlap, single-batch overlap
    (SGLang's --enable-two-batch-overlap / --enable-single-batch-overlap: not landed while EngineConfig has no such
    option) and MTP under DP attention (mtp_refusal: the engine's one-line refusal, None if it accepted it)."""
    rows = []
    for name, option, anchor in (("two-batch overlap (TBO)", "enable_two_batch_overlap", TBO_ANCHOR),
                                 ("single-batch overlap (SBO)", "enable_single_batch_overlap", SBO_ANCHOR)):
        status = "not landed" if option not in engine_options else "landed: not measured by this script yet"
        rows.append({"feature": name, "status": status, "anchor": anchor})
    mtp = ("landed for one process; not landed under DP attention: " + mtp_refusal if mtp_refusal
           else "accepted under DP attention: not measured by this script yet")
    rows.append({"feature": "MTP speculative decoding, batch 1 and 32 under DP attention", "status": mtp,
                 "anchor": "-"})  # fmt: skip
    return rows


def engine_option_names() -> frozenset[str]:
    from r3trace.engine.engine_config import EngineConfig

    return frozenset(f.name for f in fields(EngineConfig))


def _count(case: dict[str, Any], key: str) -> str:
    return "-" if case.get(key) is None else f"{case[key]:,}"


def matrix_table(result: dict[str, Any]) -> list[str]:
    m = result["matrix"]
    lines = [f"### Parallel matrix: {result['kind']}", "",
             f"Model {m['model']} ({m['dtype']}), against the one-GPU run of the same workload in the same mode; "
             f"near-tie: order gap < {m['near_tie']:g}. Backend {result['backend']}.", "",
             "| case | GPUs | result | requests | tokens differ | route mismatches / entries | near-ties (flipped) "
             "| trace problems | notes |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in m.get("references", []):
        notes = "; ".join(r.get("problems", [])[:1])
        lines.append(f"| {r['reference']} (reference) | 1 | {r['status']} | {_count(r, 'requests')} | - | - | - | - "
                     f"| {notes} |")  # fmt: skip
    for c in m["cases"]:
        ran = c["status"] in ("pass", "fail")
        routes = f"{_count(c, 'route_mismatches')} / {_count(c, 'route_entries')}" if ran else "-"
        ties = f"{c['near_ties']:,} ({c['near_tie_flips']:,})" if ran and c.get("near_ties") is not None else "-"
        notes = "; ".join(c.get("problems", [])[:2])
        lines.append(f"| {c['case']} | {c['gpus']} | {c['status']} | {_count(c, 'requests')} | "
                     f"{_count(c, 'token_mismatches')} | {routes} | {ties} | {_count(c, 'trace_problems')} | {notes} |")
    return lines


def _rate(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    text = f"{cell['tokens_per_s_per_gpu']:,.0f}"
    ratios = [f"{cell[k]:.2f}x" for k in ("vs_1gpu_eager", "vs_1gpu_graphs") if k in cell]
    return text + (f" ({' / '.join(ratios)})" if ratios else "")


def throughput_tables(result: dict[str, Any]) -> list[str]:
    t = result["throughput"]
    cfg = t["config"]
    lines = [f"### Throughput per GPU: {result['kind']}", "",
             f"Tokens/s per GPU; in brackets the ratio to one GPU eager / one GPU with CUDA graphs (same shape, same "
             f"run). Prefill: tokens per DP rank in requests of {cfg['prompt']}; decode: requests per DP rank, "
             f"{cfg['decode_prompt']}-token prompts, {cfg['new_tokens']} tokens. {cfg['dtype']}, {cfg['backend']} "
             "backends; multi-GPU decode runs eager.", ""]  # fmt: skip
    heads = [f"prefill {n // 1024}k" if n >= 1024 else f"prefill {n}" for n in cfg["prefill_tokens"]]
    heads += [f"decode B{b}" for b in cfg["batches"]]
    for shape, s in t["shapes"].items():
        lines += [f"Shape {shape}: {s.get('summary', '')}", "",
                  "| layout | GPUs | graphs | " + " | ".join(heads) + " |", "|---|---|---|" + "---|" * len(heads)]
        for r in s["rows"]:
            if "error" in r or "status" in r:
                lines.append(f"| {r.get('layout', '-')} | {r.get('gpus', '-')} | - | "
                             f"{r.get('status') or r.get('error')} |" + " |" * (len(heads) - 1))  # fmt: skip
                continue
            pre = {c["tokens_per_rank"]: c for c in r["prefill"]}
            dec = {c["batch_per_rank"]: c for c in r["decode"]}
            cells = [_rate(pre.get(n)) for n in cfg["prefill_tokens"]] + [_rate(dec.get(b)) for b in cfg["batches"]]
            lines.append(f"| {r['layout']} | {r['gpus']} | {'yes' if r['graphs'] else 'no'} | " + " | ".join(cells)
                         + " |")  # fmt: skip
        lines.append("")
    return lines


def capture_table(result: dict[str, Any]) -> list[str]:
    lines = [f"### Capture overhead: {result['kind']}", "",
             "The share of a decode step that capture adds (decode tokens/s off / on - 1, medians, same engine); "
             "goal < 1%.", "",
             f"| shape | layout | batch per rank | routes returned | trace recording | SGLang ({NOT_COMPARABLE}) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for shape, s in result["throughput"]["shapes"].items():
        for r in s["rows"]:
            for cell in r.get("decode", []):
                if "routes_overhead" not in cell and "trace_overhead" not in cell:
                    continue
                pct = [f"{100 * cell[k]:+.2f}%" if k in cell else "-" for k in ("routes_overhead", "trace_overhead")]
                lines.append(f"| {shape} | {r['layout']} | {cell['batch_per_rank']} | {pct[0]} | {pct[1]} | "
                             f"{CAPTURE_ANCHOR} |")  # fmt: skip
    return lines


def features_table(result: dict[str, Any]) -> list[str]:
    lines = [f"### Not measured: {result['kind']}", "", f"| feature | status | SGLang ({NOT_COMPARABLE}) |",
             "|---|---|---|"]  # fmt: skip
    lines += [f"| {f['feature']} | {f['status']} | {f['anchor']} |" for f in result["features"]]
    return lines


def markdown(result: dict[str, Any]) -> str:
    """Every table of a result dict, blank lines between them."""
    parts = [matrix_table(result)] if "matrix" in result else []
    if "throughput" in result:
        parts += [throughput_tables(result), capture_table(result)]
    parts.append(features_table(result))
    return "\n\n".join("\n".join(p).rstrip() for p in parts) + "\n"
