"""The training loop EAGLE heads and Medusa heads share, and the helpers around it.

A head family brings an ``Objective``: the module that trains, its loss on a batch of sequences, its validation
(held-out metrics with ``est_tokens_per_step``, the score the best checkpoint is kept by) and how it saves itself.
``train_loop`` runs the rest the same way for both: AdamW, the warm-up and cosine schedule over steps or minutes
(``checkpoints.Schedule``), gradient clipping, validation every ``val_every`` steps keeping the best, checkpoints that
``--resume`` goes on from, Ctrl-C / SIGTERM stopping after a step (``checkpoints.StopSignals``), and a progress bar.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from .data import Sequence
from .checkpoints import Schedule, StopSignals, load_checkpoint, save_checkpoint, scheduled_batches


@dataclass
class TrainReport:
    steps: int = 0
    seconds: float = 0.0
    train_tokens: int = 0
    val_history: list[dict] = field(default_factory=list)
    best: dict = field(default_factory=dict)
    continued_from: dict = field(default_factory=dict)  # the training record of the --init-head checkpoint
    tokens_per_second: float = 0.0  # trained positions per second of this run (the training signal's rate)
    finished: bool = False  # the schedule ran to its end (False: stopped by Ctrl-C, SIGTERM or should_stop; --resume goes on)


def draft_vocabulary(sequences: list[Sequence], size: int, vocab_size: int, always: set[int]) -> torch.Tensor:
    """The ``size`` target ids the target emits most often in its answers (plus ``always``), sorted: d2t."""
    counts = Counter()
    for s in sequences:
        counts.update(s.tokens[s.answer_start:].tolist())
    chosen = set(always)
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(token)
    for token in range(vocab_size):  # pad with the lowest ids when the answers use fewer distinct tokens
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen)[:size])


def cosine_lr(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up to ``peak``, then cosine decay to a tenth of it at step ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def validation_split(sequences: list[Sequence], count: int, seed: int = 0) -> tuple[list[Sequence], list[Sequence]]:
    """(train, validation): every answer to the ``count`` prompts that hash lowest (seeded) is held out (``count``
    sequences when each prompt has one answer).

    The split depends on the prompts, not on their order or number, and it is stable as data grows: a sequence
    held out from a larger set was held out from every smaller set that contains it. So a head continued on more
    data (``init_head``) is never validated on answers its first round trained on, and a prompt answered twice
    (greedy and sampled) is never trained on through one answer while validated on the other."""
    def key(s: Sequence) -> bytes:
        return hashlib.sha256(f"{seed}:".encode() + s.tokens[: s.answer_start].numpy().astype("<i8").tobytes()).digest()

    keys = [key(s) for s in sequences]
    chosen = set(sorted(set(keys))[:count])
    held = {i for i, k in enumerate(keys) if k in chosen}
    return ([s for i, s in enumerate(sequences) if i not in held], [s for i, s in enumerate(sequences) if i in held])


def make_batches(sequences: list[Sequence], batch_tokens: int, rng: random.Random) -> list[list[Sequence]]:
    """Length-sorted batches of at most ``batch_tokens`` padded tokens, in random order."""
    order = sorted(sequences, key=lambda s: len(s.tokens))
    batches, current = [], []
    for s in order:
        if current and len(s.tokens) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def epoch_batches(train: list[Sequence], text: list[Sequence], batch_tokens: int,
                  rng: random.Random) -> list[list[Sequence]]:
    """One epoch's batches: the answers', then the text corpus's (token-only, so never in a batch with cached
    features), shuffled together."""
    batches = make_batches(train, batch_tokens, rng)
    if text:
        batches += make_batches(text, batch_tokens, rng)
        rng.shuffle(batches)
    return batches


def vocabulary_coverage(sequences: list[Sequence], d2t: torch.Tensor) -> float:
    """The share of answer tokens in ``sequences`` that the draft vocabulary ``d2t`` holds."""
    allowed = torch.zeros(int(max(d2t.max().item(), max(int(s.tokens.max()) for s in sequences))) + 1, dtype=torch.bool)
    allowed[d2t] = True
    hit = total = 0
    for s in sequences:
        answer = s.tokens[s.answer_start:]
        hit += int(allowed[answer].sum())
        total += len(answer)
    return hit / max(1, total)


def training_record(meta: dict, config, report: TrainReport, coverage: float) -> dict:
    """What a trained head's config.json records of its training: data, settings (a dataclass), validation."""
    return {
        "data": {k: meta.get(k) for k in ("source", "sequences", "max_new_tokens", "dtype")}
        | ({"answer_temperatures": meta["answer_temperatures"]} if "answer_temperatures" in meta else {})
        | ({"text": meta["text"]} if "text" in meta else {}),
        "config": asdict(config),
        "steps": report.steps,
        "seconds": round(report.seconds, 1),
        "train_tokens": report.train_tokens,
        "draft_vocab_coverage": round(coverage, 4),
        "best_validation": report.best,
        "validation_history": report.val_history,
        **({"continued_from": report.continued_from} if report.continued_from else {}),
    }


class Objective(Protocol):
    """What a head family brings to ``train_loop``."""

    what: str  # its name in the progress bar ("EAGLE head")
    module: torch.nn.Module  # what trains: its parameters that require grad are optimised

    def loss(self, batch: list[Sequence], autocast: dict) -> tuple[torch.Tensor | None, int, list[float]]:
        """(the batch's loss, or None to skip it; positions trained; top-1 accuracies for the progress bar)."""

    def validate(self) -> dict:
        """Held-out metrics; ``est_tokens_per_step`` decides which checkpoint is the best."""

    def describe(self, metrics: dict) -> str:
        """One log line for ``metrics`` (with ``step``, ``epoch`` and ``seconds`` added)."""

    def save(self, report: "TrainReport") -> None:
        """Write the module, with its training record so far, as the run's result (the best so far)."""

    def record(self, report: "TrainReport") -> None:
        """Write the finished run's training record beside the saved result, if one was saved."""


def train_loop(objective: Objective, config, train: list[Sequence], text: list[Sequence], out_dir: str | Path,
               settings: dict, report: TrainReport, rng: random.Random, validate_first: bool = False,
               progress: bool = True, log: Callable[[str], None] = print,
               should_stop: Callable[[int], bool] | None = None) -> TrainReport:
    """Train ``objective.module`` on ``train`` (and the text corpus ``text``, training only) with the schedule in
    ``config`` (lr, epochs, warmup_steps, batch_tokens, max_minutes, val_every, grad_clip, resume, bf16_autocast,
    device); ``settings`` are checked against a checkpoint on ``--resume``. ``validate_first``: a continued head is
    validated before any step, and is the one to beat (a run that makes it no better leaves it as it was)."""
    from tqdm import tqdm

    module = objective.module
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = max(1, len(epoch_batches(train, text, config.batch_tokens, random.Random(0))) * config.epochs)
    best_score, step, seconds_before = -1.0, 0, 0.0
    if config.resume:
        state = load_checkpoint(out_dir, settings)
        module.load_state_dict(state["weights"])
        opt.load_state_dict(state["optimizer"])
        step, total, best_score, seconds_before = state["step"], state["total"], state["best_score"], state["seconds"]
        report = TrainReport(**state["report"])
        log(f"resuming at step {step} of {total} ({seconds_before:.0f} s trained so far)")
    elif validate_first:
        metrics = objective.validate()
        metrics.update(step=0, epoch=0, seconds=0.0)
        report.val_history.append(metrics)
        log(objective.describe(metrics))
        best_score, report.best = metrics["est_tokens_per_step"], metrics
        objective.save(report)
    # the clock starts after that first validation, so --max-minutes is all training
    schedule = Schedule(config.lr, total, config.warmup_steps, config.max_minutes, seconds_before)

    def checkpoint() -> None:
        report.steps, report.seconds = step, schedule.seconds()
        save_checkpoint(out_dir, {"settings": settings, "step": step, "total": total, "best_score": best_score,
                                  "seconds": schedule.seconds(), "report": asdict(report),
                                  "optimizer": opt.state_dict(),
                                  "weights": {k: v.detach().cpu() for k, v in module.state_dict().items()}})

    autocast = dict(device_type=torch.device(config.device).type, dtype=torch.bfloat16, enabled=config.bf16_autocast)
    bar = tqdm(total=total, initial=step, desc=f"training {objective.what}", unit="step", disable=not progress)
    stopped = False
    with StopSignals() as signals:
        for epoch, _, seqs in scheduled_batches(lambda: epoch_batches(train, text, config.batch_tokens, rng),
                                                config.epochs, step):
            if schedule.done(step):
                break
            if signals.requested or (should_stop is not None and should_stop(step)):
                stopped = True
                break
            for group in opt.param_groups:
                group["lr"] = schedule.lr(step)
            loss, trained, accs = objective.loss(seqs, autocast)
            if loss is None:
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            opt.step()
            step += 1
            report.train_tokens += trained
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}", top1="/".join(f"{a:.2f}" for a in accs))
            if step % config.val_every == 0 or schedule.done(step):
                metrics = objective.validate()
                metrics.update(step=step, epoch=epoch + 1, seconds=round(schedule.seconds(), 1))
                report.val_history.append(metrics)
                log(objective.describe(metrics))
                if metrics["est_tokens_per_step"] > best_score:
                    best_score = metrics["est_tokens_per_step"]
                    report.best = metrics
                    report.steps, report.seconds = step, schedule.seconds()
                    objective.save(report)
                checkpoint()
    bar.close()
    report.steps = step
    report.seconds = schedule.seconds()
    report.tokens_per_second = round(report.train_tokens / max(report.seconds, 1e-9), 1)
    report.finished = not stopped
    checkpoint()
    if stopped:
        log(f"stopped at step {step} of {total} ({report.seconds:.0f} s trained); go on with --resume")
    objective.record(report)
    return report
