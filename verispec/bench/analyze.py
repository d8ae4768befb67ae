"""Measurements behind ``verispec analyze``: acceptance per draft position, teacher-forced beta for model
drafters, the verify cost curve, and the predicted speedup for each k (formulas in ``verispec.analysis``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .. import analysis
from ..backends.base import TargetModel
from ..sampling import SamplingParams, probabilities


@torch.inference_mode()
def verify_cost_curve(target: TargetModel, context: Sequence[int], max_drafted: int = 16, repeats: int = 7,
                      sampling: SamplingParams | None = None,
                      progress: Callable[[], None] | None = None) -> dict[int, float]:
    """Median seconds of one engine verify step that checks j draft tokens (a target pass over j+1 tokens,
    turning logits into probabilities, cropping the cache back), for j = 0..max_drafted, after a prefill
    of ``context``. Widths are interleaved within each repeat so machine noise hits them alike."""
    sampling = sampling or SamplingParams()
    cache = target.new_kv()
    ctx = list(context)
    target.forward(cache, ctx, last_only=True)
    times: dict[int, list[float]] = {j: [] for j in range(max_drafted + 1)}
    feed_pool = ctx[-(max_drafted + 1):] * (max_drafted + 1)
    for r in range(repeats + 1):  # the first round warms up and is dropped
        for j in range(max_drafted + 1):
            t0 = time.perf_counter()
            probabilities(target.forward(cache, feed_pool[: j + 1]).logits, sampling)
            cache.truncate(len(ctx))
            if r:
                times[j].append(time.perf_counter() - t0)
            if progress:
                progress()
    return {j: statistics.median(v) for j, v in times.items()}


@torch.inference_mode()
def teacher_forced_beta(target: TargetModel, draft: TargetModel, sequences: Sequence[tuple[list[int], list[int]]],
                        sampling: SamplingParams) -> float:
    """Mean over generated positions of beta = sum_x min(p(x), q(x)), with p from the target and q from the
    draft model both conditioned on the same (prompt, generated prefix): the per-token acceptance
    probability of strict rejection sampling, free of the engine's path dependence."""
    total, count = 0.0, 0
    for prompt, generated in sequences:
        if not generated:
            continue
        ids = prompt + generated[:-1]
        n = len(generated)
        p = probabilities(target.forward(target.new_kv(), ids).logits[-n:].float(), sampling)
        q_logits = draft.forward(draft.new_kv(), ids).logits[-n:].float().to(p.device)
        vocab = min(p.shape[-1], q_logits.shape[-1])  # padded vocabularies: ids past the real ones never occur
        q = probabilities(q_logits[:, :vocab], sampling)
        total += analysis.beta(p[:, :vocab], q).sum().item()
        count += n
    return total / count if count else float("nan")


@torch.inference_mode()
def eagle_teacher_forced_beta(target: TargetModel, head, sequences: Sequence[tuple[list[int], list[int]]],
                              sampling: SamplingParams) -> float:
    """Like ``teacher_forced_beta`` for an EAGLE head at draft depth 1: q at each generated position comes from the
    head fed the target's true hidden states of the prefix (what it sees for the first draft token of a step)."""
    from ..eagle.head import HeadCache

    layers = tuple(head.config.feature_layers)
    total, count = 0.0, 0
    for prompt, generated in sequences:
        if not generated:
            continue
        ids = prompt + generated[:-1]
        n = len(generated)
        out = target.forward(target.new_kv(), ids, feature_layers=layers)
        p = probabilities(out.logits[-n:].float(), sampling)  # [n, V]
        feats = head.fuse_features(out.hidden)  # [len(ids), H]
        # pair i = (f_i, t_{i+1}) gives q for t_{i+2}: the last n pairs end at position len(ids) - 2
        g = head.step(torch.tensor(ids[1:], device=target.device), feats[:-1], HeadCache())[-(n - 1):] if n > 1 else None
        if g is None:
            continue
        full = torch.full((n - 1, p.shape[-1]), float("-inf"), device=p.device)
        full[:, head.d2t] = head.logits(g).float()
        q = probabilities(full, sampling)
        total += analysis.beta(p[1:], q).sum().item()
        count += n - 1
    return total / count if count else float("nan")


@torch.inference_mode()
def medusa_teacher_forced_beta(target: TargetModel, heads, sequences: Sequence[tuple[list[int], list[int]]],
                               sampling: SamplingParams) -> float:
    """Like ``teacher_forced_beta`` for the first Medusa head: q for t_{j+2} from the target's true final state h_j
    (what the head reads for the first draft token of a step), against p at j + 1."""
    total, count = 0.0, 0
    for prompt, generated in sequences:
        n = len(generated)
        if n < 2:
            continue
        ids = prompt + generated[:-1]
        out = target.forward(target.new_kv(), ids, feature_layers=(heads.config.final_layer,))
        p = probabilities(out.logits[-(n - 1):].float(), sampling)  # p(t_{j+2}) at the last n - 1 positions
        states = heads.states(out.hidden[-n:-1, 0], 1)[:, 0]  # h_j, one position earlier
        full = torch.full((n - 1, p.shape[-1]), float("-inf"), device=p.device)
        full[:, heads.d2t] = heads.logits(states).float()
        total += analysis.beta(p, probabilities(full, sampling)).sum().item()
        count += n - 1
    return total / count if count else float("nan")


@dataclass
class Analysis:
    drafter: str
    k_max: int
    steps: int
    position_betas: list[float]  # P(position i accepted | positions < i accepted); no draft counts as rejected
    position_acceptance: list[float]  # P(accepted | position i drafted and reached)
    draft_availability: list[float]  # share of steps that drafted at least i tokens
    teacher_forced_beta: float | None
    draft_cost_ratio: float  # c = draft seconds per drafted token / one plain decoding step
    verify_cost_ms: dict[int, float]  # j draft tokens -> ms of one verify step
    geometric_alpha: float
    predictions: list[dict] = field(default_factory=list)  # per k: expected tokens (3 ways), speedup
    optimal_k: int = 0
    measured: list[dict] = field(default_factory=list)  # per k: speedup and #MAT from a sweep
    controller: dict = field(default_factory=dict)  # the cost policy in the sweep: speedup, #MAT, plain steps
    learned_cost_ms: dict[int, float] = field(default_factory=dict)  # the controller's curve: width -> ms

    def to_dict(self) -> dict:
        return asdict(self)


def analyze(drafter: str, questions: Sequence[Sequence[tuple[int, int]]], position_acceptance: Sequence[float],
            draft_seconds: float, drafted_tokens: int,
            verify_cost: dict[int, float], k_max: int, teacher_beta: float | None = None,
            ks: Sequence[int] = range(1, 17)) -> Analysis:
    """Turn the recorded (drafted, accepted) steps of a run at ``k_max`` (one list per answer) and a verify
    cost curve into per-k predictions. The speedup is aggregated like Spec-Bench's (mean over answers of
    predicted tokens/s relative to plain decoding, whose tokens/s the model takes as the same everywhere)."""
    steps = [s for q in questions for s in q]
    if not steps:
        raise ValueError("the acceptance run recorded no steps")
    betas = analysis.position_betas(steps, k_max)
    base = verify_cost[0]
    c = (draft_seconds / drafted_tokens) / base if drafted_tokens else 0.0
    rel = analysis.interpolate({j: t / base for j, t in verify_cost.items()})
    cond = list(position_acceptance)
    avail = [sum(1 for d, _ in steps if d >= i) / len(steps) for i in range(1, k_max + 1)]
    alpha = teacher_beta if teacher_beta is not None else (cond[0] if cond else 0.0)
    answered = [q for q in questions if q]
    preds = []
    for k in ks:
        replay_tokens, _ = analysis.replay_speedup(steps, k, c, rel)
        preds.append({
            "k": k,
            # from the same steps, this equals step_speedup's capped tokens per step exactly
            "expected_tokens": analysis.expected_tokens(analysis.extend_betas(betas, k)),
            "expected_tokens_geometric": analysis.expected_tokens_geometric(min(alpha, 1.0), k),
            "predicted_tokens_per_step": replay_tokens,
            "relative_verify_cost": rel(k),
            "predicted_speedup": statistics.mean(analysis.replay_speedup(q, k, c, rel)[1] for q in answered),
            "predicted_speedup_capped": statistics.mean(analysis.step_speedup(q, k, c, rel)[1] for q in answered),
        })
    best = max(preds, key=lambda p: (p["predicted_speedup"], -p["k"]))["k"] if preds else 0
    return Analysis(drafter, k_max, len(steps), betas, cond, avail, teacher_beta, c,
                    {j: 1000 * t for j, t in verify_cost.items()}, alpha, preds, best)
