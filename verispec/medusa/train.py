"""Training Medusa heads on self-distillation data (``verispec.training.data``: only the final hidden state is read,
so EAGLE data serves too; token-only data is teacher-forced through the target per batch), on CPU or a GPU, stoppable
and resumable, in the loop EAGLE heads train in too (``verispec.training.loop``).

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

from ..backends import LoadedModel  # training reads a transformers target
from ..training.corpus import load_text
from ..training.data import Sequence, batch_features, load_meta, load_sequences
from ..training.loop import (TrainReport, draft_vocabulary, make_batches, train_loop, training_record,
                             validation_split, vocabulary_coverage)
from ..training.checkpoints import bf16_autocast
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
    bf16_autocast: bool | None = None  # None: on a GPU, and on a CPU with native bfloat16 (checkpoints.bf16_autocast)
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
    ``verispec.training.corpus``, training only); the best checkpoint (by the estimated greedy
    tokens per step on validation) is written to ``out_dir``, a resumable ``checkpoint.pt`` beside it. Token-only
    data is teacher-forced through the target per batch on ``config.device`` (see ``verispec.training.checkpoints`` for
    ``max_minutes``, ``resume``, ``should_stop`` and Ctrl-C)."""
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
    coverage = vocabulary_coverage(val, heads.d2t.cpu())
    log(f"{len(train)} training / {len(val)} validation sequences; draft vocabulary {len(heads.d2t)} tokens covers "
        f"{100 * coverage:.1f}% of validation answer tokens; {heads.num_heads} heads")
    full_head = model.get_output_embeddings().weight.detach().float()  # [V, H], for validation beta
    collate_kw = dict(model=model, device=device)

    settings = asdict(config) | {"text": text_record.get("files") or None}
    objective = _MedusaObjective(heads, config, val, full_head, collate_kw, out_dir, meta, coverage)
    return train_loop(objective, config, train, text, out_dir, settings, TrainReport(continued_from=continued_from),
                      rng, validate_first=bool(config.init_heads), progress=progress, log=log,
                      should_stop=should_stop)


class _MedusaObjective:
    """The Medusa heads' part of ``verispec.training.loop.train_loop``: head i's soft cross-entropy towards the
    target's distribution i + 2 tokens on, weighted ``head_decay ** i``; per-head validation; their folder."""

    what = "Medusa heads"

    def __init__(self, heads: MedusaHeads, config: MedusaTrainConfig, val: list[Sequence], full_head: torch.Tensor,
                 collate_kw: dict, out_dir, meta: dict, coverage: float):
        self.module = heads
        self.config, self.val, self.full_head, self.collate_kw = config, val, full_head, collate_kw
        self.out_dir, self.meta, self.coverage = out_dir, meta, coverage

    def loss(self, seqs: list[Sequence], autocast: dict):
        heads, config = self.module, self.config
        tokens, final, lengths, starts = collate_final(seqs, **self.collate_kw)
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
                accs.append(float((heads.d2t[lg.argmax(-1)] == tokens[:, i + 2:][mask[:, : tokens.shape[1] - i - 2]])
                                  .float().mean()))
        if not weight_sum:
            return None, 0, accs
        return loss / weight_sum, trained, accs

    def validate(self) -> dict:
        return validate(self.module, self.val, self.config, self.full_head, **self.collate_kw)

    def describe(self, metrics: dict) -> str:
        return format_metrics(metrics)

    def save(self, report: TrainReport) -> None:
        self.module.config.training = training_record(self.meta, self.config, report, self.coverage)
        self.module.save(self.out_dir)

    def record(self, report: TrainReport) -> None:
        if (Path(self.out_dir) / "config.json").exists():
            cfg = MedusaConfig.load(Path(self.out_dir))
            cfg.training = training_record(self.meta, self.config, report, self.coverage)
            cfg.save(Path(self.out_dir))


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
