"""Training Medusa heads on self-distillation data (``verispec.eagle.data``: only the final hidden state is read, so
EAGLE data serves too; token-only data is teacher-forced through the target per batch), on CPU or a GPU, stoppable
and resumable like EAGLE training (``verispec.eagle.runs``).

Loss (Medusa-1 with soft labels): at position j, head i is trained towards the target's own distribution of
t_{j+i+2}, i.e. its frozen lm_head applied to the cached final state h_{j+i+1}, over the draft vocabulary; soft
cross-entropy weighted ``head_decay ** i``. The target is frozen and never run: one epoch costs the heads' own
matrix products only. Validation on held-out sequences reports, per head, top-1 agreement with the target's own
token (its greedy answer) and beta = sum_x min(p(x), q(x)) at temperature 1 over the full vocabulary.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ..backends.hf import LoadedModel
from ..eagle.data import Sequence, batch_features, load_meta, load_sequences
from ..eagle.runs import (Schedule, StopSignals, bf16_autocast, load_checkpoint, save_checkpoint,
                          scheduled_batches)
from ..eagle.corpus import load_text
from ..eagle.train import (TrainReport, draft_vocabulary, epoch_batches, make_batches, training_record,
                           validation_split, vocabulary_coverage)
from .head import MedusaConfig, MedusaHeads, config_for


@dataclass
class MedusaTrainConfig:
    num_heads: int = 4
    layers: int = 1  # residual blocks per head
    epochs: int = 4
    lr: float = 1e-3
    warmup_steps: int = 30
    batch_tokens: int = 8192  # padded tokens per optimisation step
    head_decay: float = 0.8
    draft_vocab_size: int = 8192
    val_sequences: int = 64
    val_every: int = 100
    grad_clip: float = 0.5
    seed: int = 0
    prompt_loss: bool = True  # also learn the target's distribution inside prompts
    bf16_autocast: bool | None = None  # None: on a GPU, and on a CPU with native bfloat16 (runs.bf16_autocast)
    init_heads: str | None = None  # continue from these trained heads (weights and draft vocabulary)
    device: str = "cpu"  # where the heads train (and token-only data is teacher-forced)
    max_minutes: float | None = None  # the schedule ends after this many minutes of training if its steps do not
    resume: bool = False  # go on from the checkpoint in the output folder


def collate_final(sequences: list[Sequence], model=None,
                  device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, T], final states [B, T, H], lengths [B], answer starts [B]) of a padded batch on ``device``. The
    final states are the cached ones (bfloat16), or for token-only data the target ``model``'s, computed now."""
    width = max(len(s.tokens) for s in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, s in enumerate(sequences):
        tokens[row, : len(s.tokens)] = s.tokens
    lengths = torch.tensor([len(s.tokens) for s in sequences])
    starts = torch.tensor([s.answer_start for s in sequences])
    if sequences[0].features is None:
        if model is None:
            raise ValueError("token-only data needs the target model to teacher-force")
        real = (torch.arange(width)[None, :] < lengths[:, None]).long()
        with torch.no_grad():
            final = batch_features(model, tokens.to(device), real.to(device), [])[:, :, -1]
        return tokens.to(device), final, lengths.to(device), starts.to(device)
    final = torch.zeros(len(sequences), width, sequences[0].features.shape[-1], dtype=torch.bfloat16)
    for row, s in enumerate(sequences):
        final[row, : len(s.tokens)] = s.features[:, -1]
    return tokens.to(device), final.to(device), lengths.to(device), starts.to(device)


def head_mask(lengths: torch.Tensor, starts: torch.Tensor, width: int, head: int, answers_only: bool) -> torch.Tensor:
    """[B, T]: positions j where head ``head`` has a label, the text's token t_{j+head+2} (in the answer when
    ``answers_only``)."""
    j = torch.arange(width, device=lengths.device)[None, :]
    label = j + head + 2
    mask = label < lengths[:, None]
    if answers_only:
        mask &= label >= starts[:, None]
    return mask


def _labels_at(p: torch.Tensor, mask: torch.Tensor, head: int) -> torch.Tensor:
    """Rows of ``p`` [B, T, D] at j + head + 1 for the positions j of ``mask``."""
    shift = head + 1
    return p[:, shift:][mask[:, : mask.shape[1] - shift]]


def train_medusa(target: LoadedModel, data_dir: str | Path, out_dir: str | Path, config: MedusaTrainConfig,
                 progress: bool = True, log: Callable[[str], None] = print,
                 should_stop: Callable[[int], bool] | None = None, text_dirs: list[str | Path] = ()) -> TrainReport:
    """Train Medusa heads for ``target`` on the data in ``data_dir`` (and the text corpora in ``text_dirs``,
    ``verispec.eagle.corpus``, training only); the best checkpoint (by the estimated greedy
    tokens per step on validation) is written to ``out_dir``, a resumable ``checkpoint.pt`` beside it. Token-only
    data is teacher-forced through the target per batch on ``config.device`` (see ``verispec.eagle.runs`` for
    ``max_minutes``, ``resume``, ``should_stop`` and Ctrl-C)."""
    from tqdm import tqdm

    meta = load_meta(data_dir)
    device = torch.device(config.device)
    config = replace(config, bf16_autocast=bf16_autocast(config.bf16_autocast, device))  # the record says which
    if target.device.type != device.type:
        raise ValueError(f"the target is on {target.device}, training on {device}: load it with device={config.device!r}")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    online = not meta.get("features", True)
    log(f"loading {'answers (teacher-forced per batch)' if online else 'cached final hidden states'} from {data_dir} ...")
    sequences = [s if s.features is None else Sequence(s.tokens, s.answer_start, s.features[:, -1:].clone())
                 for s in load_sequences(data_dir)]
    if len(sequences) < 2:
        raise ValueError(f"{data_dir} holds {len(sequences)} sequences; build more data first")
    meta = dict(meta, sequences=len(sequences))
    train, val = validation_split(sequences, min(config.val_sequences, max(1, len(sequences) // 10)), config.seed)
    text, text_record = load_text(text_dirs, target.name) if text_dirs else ([], {})
    if text_record:
        meta["text"] = text_record
        log(f"text corpus: {text_record['sequences']} sequences, {text_record['tokens']} tokens (training only)")
    model = target.model
    if config.init_heads:
        heads = MedusaHeads.load(config.init_heads)
        config = replace(config, num_heads=heads.num_heads, layers=heads.config.layers)  # the record says what ran
        continued_from = {"heads": str(config.init_heads), "training": heads.config.training}
    else:
        d2t = draft_vocabulary(train, config.draft_vocab_size, target.vocab_size, set(target.eos_token_ids))
        heads = MedusaHeads(config_for(model, target.name, config.num_heads, len(d2t), config.layers))
        heads.d2t.copy_(d2t)
        continued_from = {}
    heads.to(device)
    heads.train()  # before attach: heads loaded for drafting (eval) would pack their weights for inference
    heads.attach(model)  # heads continued from another target's checkpoint are refused here
    heads.lm_head_d = heads.lm_head_d.float()
    d2t = heads.d2t
    coverage = vocabulary_coverage(val, d2t.cpu())
    log(f"{len(train)} training / {len(val)} validation sequences; draft vocabulary {len(d2t)} tokens covers "
        f"{100 * coverage:.1f}% of validation answer tokens; {heads.num_heads} heads")
    full_head = model.get_output_embeddings().weight.detach().float()  # [V, H], for validation beta
    collate_kw = dict(model=model, device=device)

    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = max(1, len(epoch_batches(train, text, config.batch_tokens, random.Random(0))) * config.epochs)
    report = TrainReport(continued_from=continued_from)
    best_score = -1.0
    step, seconds_before = 0, 0.0
    settings = asdict(config) | {"text": text_record.get("files") or None}
    if config.resume:
        state = load_checkpoint(out_dir, settings)
        heads.load_state_dict(state["weights"])
        opt.load_state_dict(state["optimizer"])
        step, total, best_score, seconds_before = state["step"], state["total"], state["best_score"], state["seconds"]
        report = TrainReport(**state["report"])
        log(f"resuming at step {step} of {total} ({seconds_before:.0f} s trained so far)")
    elif config.init_heads:  # where the continued heads start, on this run's validation answers: the ones to beat
        metrics = validate(heads, val, config, full_head, **collate_kw)
        metrics.update(step=0, epoch=0, seconds=0.0)
        report.val_history.append(metrics)
        log(format_metrics(metrics))
        best_score, report.best = metrics["est_tokens_per_step"], metrics
        heads.config.training = training_record(meta, config, report, coverage)
        heads.save(out_dir)
    # the clock starts after that first validation, so --max-minutes is all training
    schedule = Schedule(config.lr, total, config.warmup_steps, config.max_minutes, seconds_before)

    def checkpoint() -> None:
        report.steps, report.seconds = step, schedule.seconds()
        save_checkpoint(out_dir, {"settings": settings, "step": step, "total": total, "best_score": best_score,
                                  "seconds": schedule.seconds(), "report": asdict(report),
                                  "optimizer": opt.state_dict(),
                                  "weights": {k: v.detach().cpu() for k, v in heads.state_dict().items()}})

    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=config.bf16_autocast)
    bar = tqdm(total=total, initial=step, desc="training Medusa heads", unit="step", disable=not progress)
    stopped = False
    with StopSignals() as signals:
        for epoch, _, seqs in scheduled_batches(lambda: epoch_batches(train, text, config.batch_tokens, rng),
                                                config.epochs, step):
            if schedule.done(step):
                break
            if signals.requested or (should_stop is not None and should_stop(step)):
                stopped = True
                break
            tokens, final, lengths, starts = collate_final(seqs, **collate_kw)
            for group in opt.param_groups:
                group["lr"] = schedule.lr(step)
            with torch.no_grad():  # the target's distribution over the draft vocabulary at every position
                p = torch.softmax(final.float() @ heads.lm_head_d.T, dim=-1)
            with torch.autocast(**autocast):
                states = heads.states(final.float())  # [B, T, K, H]
            loss, weight_sum, accs, trained = 0.0, 0.0, [], 0
            for i in range(heads.num_heads):
                mask = head_mask(lengths, starts, tokens.shape[1], i, not config.prompt_loss)
                if not mask.any():
                    continue
                with torch.autocast(**autocast):
                    lg = heads.logits(states[:, :, i][mask])
                logq = torch.log_softmax(lg.float(), dim=-1)
                loss = loss + (config.head_decay ** i) * -(_labels_at(p, mask, i) * logq).sum(-1).mean()
                weight_sum += config.head_decay ** i
                trained += int(mask.sum())
                with torch.no_grad():
                    accs.append(float((d2t[lg.argmax(-1)] == tokens[:, i + 2:][mask[:, : tokens.shape[1] - i - 2]])
                                      .float().mean()))
            if not weight_sum:
                continue
            loss = loss / weight_sum
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            opt.step()
            step += 1
            report.train_tokens += trained
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}", top1="/".join(f"{a:.2f}" for a in accs))
            if step % config.val_every == 0 or schedule.done(step):
                metrics = validate(heads, val, config, full_head, **collate_kw)
                metrics.update(step=step, epoch=epoch + 1, seconds=round(schedule.seconds(), 1))
                report.val_history.append(metrics)
                log(format_metrics(metrics))
                if metrics["est_tokens_per_step"] > best_score:
                    best_score = metrics["est_tokens_per_step"]
                    report.best = metrics
                    report.steps, report.seconds = step, schedule.seconds()
                    heads.config.training = training_record(meta, config, report, coverage)
                    heads.save(out_dir)
                checkpoint()
    bar.close()
    report.steps = step
    report.seconds = schedule.seconds()
    report.tokens_per_second = round(report.train_tokens / max(report.seconds, 1e-9), 1)
    report.finished = not stopped
    checkpoint()
    if stopped:
        log(f"stopped at step {step} of {total} ({report.seconds:.0f} s trained); go on with --resume")
    if (Path(out_dir) / "config.json").exists():
        cfg = MedusaConfig.load(Path(out_dir))
        cfg.training = training_record(meta, config, report, coverage)
        cfg.save(Path(out_dir))
    return report


@torch.no_grad()
def validate(heads: MedusaHeads, sequences: list[Sequence], config: MedusaTrainConfig, full_head: torch.Tensor,
             model=None, device: str | torch.device = "cpu") -> dict:
    """Per head, on answer positions: top-1 agreement with the target's own token t_{j+i+2}, and beta at
    temperature 1 over the full vocabulary (q is zero outside the draft vocabulary)."""
    heads.eval()
    k = heads.num_heads
    hits, betas, count = [0] * k, [0.0] * k, [0] * k
    for seqs in make_batches(sequences, config.batch_tokens, random.Random(0)):
        tokens, final, lengths, starts = collate_final(seqs, model, device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=config.bf16_autocast):
            states = heads.states(final.float())
        for i in range(k):
            mask = head_mask(lengths, starts, tokens.shape[1], i, answers_only=True)
            if not mask.any():
                continue
            lg = heads.logits(states[:, :, i][mask].float())
            label = tokens[:, i + 2:][mask[:, : tokens.shape[1] - i - 2]]
            hits[i] += int((heads.d2t[lg.argmax(-1)] == label).sum())
            p = torch.softmax(final[:, i + 1:][mask[:, : tokens.shape[1] - i - 1]].float() @ full_head.T, dim=-1)
            betas[i] += float(torch.minimum(p[:, heads.d2t], torch.softmax(lg, dim=-1)).sum())
            count[i] += int(mask.sum())
    heads.train()
    top1 = [h / max(1, c) for h, c in zip(hits, count)]
    # greedy tokens per step of a chain: head i is right given the earlier ones were, with probability top1[i]
    est, run = 1.0, 1.0
    for a in top1:
        run *= a
        est += run
    return {"top1": [round(a, 4) for a in top1], "beta": [round(b / max(1, c), 4) for b, c in zip(betas, count)],
            "est_tokens_per_step": round(est, 3)}


def format_metrics(m: dict) -> str:
    return (f"step {m['step']} (epoch {m['epoch']}, {m['seconds']:.0f} s): top-1 by head "
            f"{' / '.join(f'{a:.3f}' for a in m['top1'])}, beta {' / '.join(f'{b:.3f}' for b in m['beta'])}, "
            f"est. greedy tokens/step (chain) {m['est_tokens_per_step']:.2f}")
