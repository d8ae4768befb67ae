"""PNG plots of a benchmark summary (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def _label(summary: dict, method: str) -> str:
    """A method's legend entry, marked where its speed is not like for like (a changed model, a lossy rule)."""
    s = summary["overall"].get(method, {})
    return method + (" (CHANGED MODEL)" if s.get("changed_model") else "") + (" (LOSSY)" if s.get("lossy") else "")


def _where(summary: dict) -> str:
    """The machine a run measured, for a chart's title: CPU, its widest vector flag, cores and date."""
    env = summary.get("environment") or {}
    if not env.get("cpu"):
        return ""
    flags = env.get("cpu_flags") or []
    widest = next((f for f in ("amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags), "")
    return (f"{env['cpu']}{f' ({widest})' if widest else ''}, {env.get('cpu_count', '?')} cores, "
            f"{str(env.get('date', ''))[:10]}")


def speedup_by_group(summary: dict, path: Path) -> Path:
    """Grouped bars: speedup of each method in each group and overall; the reference's 1.0 as a line. A method that
    runs a changed model (a re-quantization) is hatched and says so in the legend."""
    plt = _pyplot()
    groups = list(summary["groups"]) + ["overall"]
    methods = [m for m in summary["overall"] if m != summary["reference"]] or list(summary["overall"])
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups) + 2), 4))
    for i, m in enumerate(methods):
        blocks = [summary["overall"] if g == "overall" else summary["groups"][g] for g in groups]
        values = [b.get(m, {}).get("speedup") or 0.0 for b in blocks]
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(groups))]
        changed = bool(summary["overall"].get(m, {}).get("changed_model"))
        ax.bar(xs, values, width, label=_label(summary, m), hatch="//" if changed else None)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(f"speedup over {summary['reference']}")
    where = _where(summary)
    ax.set_title("Speedup per group (mean tokens/s ratio)" + (f"\n{where}" if where else ""))
    ax.legend(fontsize="small")
    return _save(fig, path)


def acceptance_by_position(summary: dict, path: Path) -> Path | None:
    """P(accept | draft position reached) per position, for methods that report their drafts."""
    series = {m: s["position_acceptance"] for m, s in summary["overall"].items() if s.get("position_acceptance")}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, values in series.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=_label(summary, m))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance rate at i (given i reached)")
    ax.set_ylim(0, 1.05)
    where = _where(summary)
    ax.set_title("Acceptance by draft position" + (f"\n{where}" if where else ""))
    ax.legend(fontsize="small")
    return _save(fig, path)


def analysis_plot(r, path: Path) -> Path:
    """Acceptance by draft position (left) and predicted vs measured speedup per k (right)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(range(1, len(r.position_betas) + 1), r.position_betas, label="beta_i (missing draft = rejection)")
    # a tree's acceptance is by depth: fewer positions than its node budget
    left.plot(range(1, len(r.position_acceptance) + 1), r.position_acceptance, "o-", color="black",
              label="P(accept | drafted)")
    if r.teacher_forced_beta is not None:
        left.axhline(r.teacher_forced_beta, linestyle="--", color="red", label="teacher-forced beta")
    left.set_xlabel("draft position i")
    left.set_ylim(0, 1.05)
    left.set_title("Acceptance by draft position")
    left.legend(fontsize="small")
    ks = [p["k"] for p in r.predictions]
    right.plot(ks, [p["predicted_speedup"] for p in r.predictions], "-", label="predicted")
    if r.measured:
        right.plot([m["k"] for m in r.measured], [m["speedup"] for m in r.measured], "o", label="measured (sweep)")
    right.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    right.set_xlabel("k (draft tokens per step)")
    right.set_ylabel("speedup over plain decoding")
    right.set_title(f"Speedup vs k ({r.drafter})")
    right.legend(fontsize="small")
    return _save(fig, path)


def pass_costs(summary: dict, path: Path) -> Path:
    """``verispec costs``'s curve from its JSON summary (widths as string keys): ms a pass by width for each engine
    with the memory floor as a line and, where timed, an engine's products with their weights in cache as a dashed
    one (left), and c(w) / c(1) beside 1 and w (right)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    widths = sorted({int(w) for r in summary["engines"].values() for w in r["ms"]})
    for name, r in summary["engines"].items():
        ws = sorted(int(w) for w in r["ms"])
        ms = [r["ms"][str(w)] for w in ws]
        left.plot(ws, ms, marker="o", label=name)
        right.plot(ws, [m / ms[0] for m in ms], marker="o", label=name)
        cached = r.get("products_in_cache_ms")  # --arithmetic-floor: the pass's products with weights in cache
        if cached:
            line = left.lines[-1]
            left.plot(ws, [cached[str(w)]["all"] for w in ws], linestyle="--", color=line.get_color(),
                      label=f"{name}: its products, weights in cache")
    if summary.get("floor_ms"):
        left.axhline(summary["floor_ms"], color="gray", linestyle=":",
                     label=f"memory floor ({summary['floor_ms']:.1f} ms at {summary['bandwidth_gbs']:.1f} GB/s)")
    right.plot(widths, widths, color="gray", linestyle=":", label="w one-token passes")
    right.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="one-token pass")
    left.set(xlabel="pass width w (tokens)", ylabel="ms a pass", ylim=(0, None),
             title=f"{summary['target']}: one pass after {summary['context']} cached tokens")
    right.set(xlabel="pass width w (tokens)", ylabel="c(w) / c(1)", ylim=(0, None),
              title=f"{summary.get('cpu', '')}, {summary['threads']} threads")
    for ax in (left, right):
        ax.legend(fontsize="small")
        ax.set_xticks(widths)
    return _save(fig, path)
