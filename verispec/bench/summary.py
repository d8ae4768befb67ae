"""Summaries of raw benchmark records, following Spec-Bench's conventions.

- tokens/s of a question = its new tokens over its wall time, summed over its turns;
- speedup = mean per-question tokens/s of the method / mean per-question tokens/s of the reference
  (``baseline`` when it ran), over the same questions;
- #MAT = tokens committed per target step, bonus token included (sum of step tokens / number of steps);
- acceptance rate = accepted draft tokens / drafted tokens (methods that report their drafts);
- token latency = a step's wall time shared equally by the tokens it committed (the first step includes
  the prefill), P50 and P99 over all tokens;
- identical = share of (question, turn) outputs token-identical to the reference's (greedy runs only).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from ..analysis import percentile
from .quality import loops


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _question_tps(records: Sequence[dict]) -> dict[str, float]:
    tokens: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    for r in records:
        tokens[r["question_id"]] += r["new_tokens"]
        seconds[r["question_id"]] += r["wall_seconds"]
    return {q: tokens[q] / seconds[q] for q in tokens if seconds[q] > 0}


def position_acceptance(records: Sequence[dict]) -> list[float]:
    """P(accepted at draft position i | drafted and reached), pooled over records."""
    drafted: list[int] = []
    accepted: list[int] = []
    for r in records:
        for i, (d, a) in enumerate(zip(r["drafted_per_position"], r["accepted_per_position"])):
            if i >= len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def method_summary(records: Sequence[dict], reference: Sequence[dict] | None, greedy: bool) -> dict:
    """Summary of one method's records, with speedup and identity against the reference's records."""
    tps = _question_tps(records)
    steps = sum(r["verify_steps"] for r in records)
    reports_drafts = all(r["step_drafted"] is not None for r in records)
    drafted = sum(sum(r["step_drafted"]) for r in records) if reports_drafts else 0
    accepted = sum(sum(r["step_accepted"]) for r in records) if reports_drafts else 0
    latencies = [x for r in records for x in r["token_latencies"]]
    out = {
        "questions": len(tps),
        "records": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "tokens_per_second": _mean(list(tps.values())),
        "speedup": None,
        "mean_accepted_tokens": sum(sum(r["step_tokens"]) for r in records) / steps if steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "drafted": drafted if reports_drafts else None,
        "accepted": accepted if reports_drafts else None,
        "latency_p50_ms": None if not latencies else 1000 * percentile(latencies, 50),
        "latency_p99_ms": None if not latencies else 1000 * percentile(latencies, 99),
        "identical": None,
        "lossy": any(r["lossy"] for r in records),
        "changed_model": next((r.get("changed_model") for r in records if r.get("changed_model")), ""),
        "looping": sum(loops(r["token_ids"]) for r in records),
        "position_acceptance": position_acceptance(records) if reports_drafts else None,
    }
    if reference is not None:
        ref_tps = _question_tps(reference)
        common = [q for q in tps if q in ref_tps]
        if common:
            out["speedup"] = _mean([tps[q] for q in common]) / _mean([ref_tps[q] for q in common])
        if greedy:
            ref_ids = {(r["question_id"], r["turn"]): r["token_ids"] for r in reference}
            pairs = [(r["token_ids"], ref_ids[(r["question_id"], r["turn"])]) for r in records
                     if (r["question_id"], r["turn"]) in ref_ids]
            if pairs:
                out["identical"] = sum(a == b for a, b in pairs) / len(pairs)
    return out


def summarize(records: Sequence[dict], reference: str, greedy: bool) -> dict:
    """{"reference", "groups": {group: {method: summary}}, "overall": {method: summary}} in record order."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    groups = list(dict.fromkeys(r["group"] for r in records))

    def block(rs: Sequence[dict]) -> dict:
        by_method: dict[str, list[dict]] = defaultdict(list)
        for r in rs:
            by_method[r["method"]].append(r)
        ref = by_method.get(reference)
        return {m: method_summary(by_method[m], ref, greedy) for m in methods if by_method[m]}

    return {
        "reference": reference,
        "greedy": greedy,
        "groups": {g: block([r for r in records if r["group"] == g]) for g in groups},
        "overall": block(records),
    }


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def label(method: str, s: dict) -> str:
    """A method's name as tables show it: lossy acceptance and changed weights said beside it."""
    return method + (" (LOSSY)" if s["lossy"] else "") + (" (CHANGED MODEL)" if s.get("changed_model") else "")


def markdown(summary: dict) -> str:
    """Two tables: speedup per group (Spec-Bench's layout) and the overall detail per method, with each method's
    quality (perplexity and top-1 agreement with the model's own weights, where measured) and its looping answers."""
    groups = list(summary["groups"])
    methods = list(summary["overall"])
    ref = summary["reference"]
    lines = [f"Speedup over `{ref}` (mean tokens/s ratio, Spec-Bench convention)", "",
             "| method | " + " | ".join(groups) + " | overall |",
             "|---" * (len(groups) + 2) + "|"]
    for m in methods:
        cells = [_fmt(summary["groups"][g].get(m, {}).get("speedup"), ".2f", "x") for g in groups]
        lines.append(f"| {label(m, summary['overall'][m])} | " + " | ".join(cells) + f" | {_fmt(summary['overall'][m]['speedup'], '.2f', 'x')} |")
    lines += ["", "Overall detail", "",
              "| method | questions | tokens | tok/s | speedup | #MAT | acceptance | latency P50 | latency P99 | "
              "identical to reference | looping answers | perplexity | top-1 vs own weights |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    quality = summary.get("quality", {})
    for m in methods:
        s = summary["overall"][m]
        identical = "n/a (sampling)" if not summary["greedy"] else _fmt(
            None if s["identical"] is None else 100 * s["identical"], ".0f", "%")
        q = quality.get(m) or {}
        agree = q.get("top1_agreement")
        lines.append(
            f"| {label(m, s)} | {s['questions']} | {s['new_tokens']} | {_fmt(s['tokens_per_second'], '.1f')} | "
            f"{_fmt(s['speedup'], '.2f', 'x')} | {_fmt(s['mean_accepted_tokens'])} | "
            f"{_fmt(None if s['acceptance_rate'] is None else 100 * s['acceptance_rate'], '.1f', '%')} | "
            f"{_fmt(s['latency_p50_ms'], '.1f', ' ms')} | {_fmt(s['latency_p99_ms'], '.1f', ' ms')} | {identical} | "
            f"{s['looping']}/{s['records']} | {_fmt(q.get('perplexity'), '.3f')} | "
            f"{_fmt(None if agree is None else 100 * agree, '.2f', '%')} |")
    changed = [f"- {m}: {summary['overall'][m]['changed_model']}" for m in methods
               if summary["overall"][m].get("changed_model")]
    if changed:
        lines += ["", "CHANGED MODEL: these run other weights than the model's own, so their speed is not a like-for-like "
                  "comparison:", *changed]
    if quality:
        lines += ["", "Perplexity: teacher-forced on held-out Spec-Bench first turns (verispec.bench.quality); top-1 vs own "
                  "weights: share of positions whose argmax equals the model's own weights' in float32. Looping "
                  "answers end in a repetition loop (verispec.bench.quality.loops)."]
    return "\n".join(lines) + "\n"
