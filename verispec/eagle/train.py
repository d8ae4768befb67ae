"""Training an EAGLE head on self-distillation data (``verispec.training.data``): cached features, or token-only data
teacher-forced through the target per batch; on CPU or a GPU (``device``), stoppable and resumable, in the loop
Medusa's heads train in too (``verispec.training.loop``).

Loss: soft cross-entropy between the target's distribution over the draft vocabulary (its frozen lm_head applied
to the cached final hidden state) and the head's q, at every position (the target's distribution is a valid label
inside the prompt too; ``prompt_loss=False`` keeps answers only), for each of ``ttt_steps`` unrolled
draft depths (training-time test), weighted ``step_decay ** depth``. Validation on held-out sequences reports,
per depth, top-1 agreement with the target's own next token and beta = sum_x min(p(x), q(x)) at temperature 1.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..backends import LoadedModel  # training reads a transformers target
from ..training.corpus import load_text
from ..training.data import Sequence, batch_features, load_meta, load_sequences
from ..training.loop import (TrainReport, draft_vocabulary, make_batches,
                             train_loop, training_record, validation_split, vocabulary_coverage)
from ..training.checkpoints import bf16_autocast
from .head import WEIGHTS, EagleHead, HeadConfig, head_config_for, ttt_mask


@dataclass
class TrainConfig:
    epochs: int = 6
    lr: float = 1e-3
    warmup_steps: int = 50
    batch_tokens: int = 4096  # padded tokens per optimisation step
    ttt_steps: int = 2  # unrolled draft depths
    step_decay: float = 0.8
    draft_vocab_size: int = 8192
    val_sequences: int = 64
    val_every: int = 200  # optimisation steps between validations
    grad_clip: float = 0.5
    seed: int = 0
    prompt_loss: bool = True  # also learn the target's distribution at prompt positions (its soft labels)
    init_from_layer: int | None = -1  # copy the target's decoder layer (index) into the head; None = random
    feature_layers: list[int] | None = None  # among the cached ones (and the final one); None = all of them
    bf16_autocast: bool | None = None  # None: on a GPU, and on a CPU with native bfloat16 (checkpoints.bf16_autocast)
    init_head: str | None = None  # continue from this trained head (its weights and draft vocabulary)
    intermediate_size: int | None = None  # the head's MLP width (None: the target's; with init_head: widen it to this)
    device: str = "cpu"  # where the head trains (and token-only data is teacher-forced): cpu, cuda, ...
    max_minutes: float | None = None  # the schedule ends after this many minutes of training if its steps do not
    resume: bool = False  # go on from the checkpoint in the output folder


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T]
    features: torch.Tensor  # [B, T, L, H]
    final: torch.Tensor  # [B, T, H]
    loss_mask: torch.Tensor  # [B, T-1]: pairs i that are trained (every position with a label, or answers only)
    labels: torch.Tensor  # [B, T-1]: t_{i+2}, the next token in the text (0 where there is none)
    answer_mask: torch.Tensor  # [B, T-1]: pairs i whose t_{i+2} is in the target's own answer (scored there)


def collate(sequences: list[Sequence], select: list[int] | None = None, prompt_loss: bool = False,
            model=None, layers: list[int] | None = None, device: str | torch.device = "cpu") -> Batch:
    """Pad a batch on ``device``; ``select`` picks the head's feature layers among the cached ones (default: all but
    the last, which is the final state the labels come from). Token-only sequences (no cached features) are
    teacher-forced through ``model`` here: its hidden states at ``layers`` and its final state."""
    width = max(len(s.tokens) for s in sequences)
    b = len(sequences)
    tokens = torch.zeros(b, width, dtype=torch.long)
    real = torch.zeros(b, width, dtype=torch.long)
    answer = torch.zeros(b, width - 1, dtype=torch.bool)
    everywhere = torch.zeros(b, width - 1, dtype=torch.bool)
    for row, s in enumerate(sequences):
        n = len(s.tokens)
        tokens[row, :n] = s.tokens
        real[row, :n] = 1
        answer[row, max(0, s.answer_start - 2): n - 2] = True  # pairs i whose label t_{i+2} is in the answer
        everywhere[row, : n - 2] = True
    labels = torch.cat([tokens[:, 2:], torch.zeros(b, 1, dtype=torch.long)], dim=1)
    tokens, labels, answer, everywhere = (t.to(device) for t in (tokens, labels, answer, everywhere))
    if sequences[0].features is None:
        if model is None or not layers:
            raise ValueError("token-only data needs the target model and its feature layers to teacher-force")
        with torch.no_grad():
            feats = batch_features(model, tokens, real.to(device), layers)
        return Batch(tokens, feats[:, :, :-1], feats[:, :, -1], everywhere if prompt_loss else answer, labels, answer)
    n_layers, hidden = sequences[0].features.shape[1:]
    feats = torch.zeros(b, width, n_layers, hidden, dtype=torch.bfloat16)
    for row, s in enumerate(sequences):
        feats[row, : len(s.tokens)] = s.features
    feats = feats.to(device)
    chosen = feats[:, :, :-1] if select is None else feats[:, :, select]
    return Batch(tokens, chosen, feats[:, :, -1], everywhere if prompt_loss else answer, labels, answer)


def unrolled_states(head: EagleHead, batch: Batch, steps: int) -> list[torch.Tensor]:
    """Head outputs g [B, T-1, H] for each unrolled depth s = 0..steps-1. Depth s at position i sees the true
    features up to i - s and its own outputs after that, exactly as the drafter does at draft depth s."""
    tok_in = batch.tokens[:, 1:]  # t_{i+1}
    t = tok_in.shape[1]
    positions = torch.arange(t, device=tok_in.device)
    feature = head.fuse_features(batch.features[:, :-1].float())  # f_i
    keys, values, out = [], [], []
    g = None
    for s in range(steps):
        if s:
            feature = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # g of depth s-1 at i-1
        x = head.inputs(tok_in, feature)
        q, k, v = head.qkv(x, positions)
        keys.append(k)
        values.append(v)
        if s == 0:
            g = head.finish(x, q, k, v, None, causal=True)
        else:
            mask = ttt_mask(t, s, device=tok_in.device)
            g = head.finish(x, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        out.append(g)
    return out


def default_feature_layers(n_layers: int) -> list[int]:
    """Three intermediate layers (2, L/2, L-2) and the final normed state (L), EAGLE-3's choice."""
    return [2, n_layers // 2, n_layers - 2, n_layers]


def train_head(target: LoadedModel, data_dir: str | Path, out_dir: str | Path, config: TrainConfig,
               progress: bool = True, log: Callable[[str], None] = print,
               should_stop: Callable[[int], bool] | None = None, text_dirs: list[str | Path] = ()) -> TrainReport:
    """Train a head for ``target`` on the data in ``data_dir``; the best checkpoint (by validation acceptance) is
    written to ``out_dir``, with a resumable ``checkpoint.pt`` beside it (see ``verispec.training.checkpoints``). Token-only data is
    teacher-forced through the target batch by batch on ``config.device``, where the target must live too.
    ``text_dirs``: text corpora (``corpus.py``) teacher-forced the same way, added to the training set only.
    ``should_stop(step)`` (or Ctrl-C / SIGTERM) ends the run after a step with a checkpoint; ``config.resume`` goes on."""
    meta = load_meta(data_dir)
    device = torch.device(config.device)
    config = replace(config, bf16_autocast=bf16_autocast(config.bf16_autocast, device))  # the record says which
    if target.device.type != device.type:
        raise ValueError(f"the target is on {target.device}, training on {device}: load it with device={config.device!r}")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    log(f"loading {'cached features' if meta.get('features', True) else 'answers (teacher-forced per batch)'} "
        f"from {data_dir} ...")
    sequences = list(load_sequences(data_dir))
    if len(sequences) < 2:
        raise ValueError(f"{data_dir} holds {len(sequences)} sequences; build more data first")
    meta = dict(meta, sequences=len(sequences))  # what this run trains and validates on, for the record
    online = sequences[0].features is None
    train, val = validation_split(sequences, min(config.val_sequences, max(1, len(sequences) // 10)), config.seed)
    text, text_record = load_text(text_dirs, target.name) if text_dirs else ([], {})
    if text_record:
        meta["text"] = text_record
        log(f"text corpus: {text_record['sequences']} sequences, {text_record['tokens']} tokens from "
            f"{', '.join(text_record['files'])} (training only, teacher-forced per batch)")
    if config.init_head:
        head = EagleHead.load(config.init_head)  # continue training: keep its weights and draft vocabulary
        d2t = head.d2t.clone()
    else:
        d2t = draft_vocabulary(train, config.draft_vocab_size, target.vocab_size, set(target.eos_token_ids))
    coverage = vocabulary_coverage(val, d2t)
    log(f"{len(train)} training / {len(val)} validation sequences; draft vocabulary {len(d2t)} tokens covers "
        f"{100 * coverage:.1f}% of validation answer tokens")

    model = target.model
    final = model.config.num_hidden_layers  # hidden_states[final] is the final normed state, cached last
    if online:  # any hidden state can be read: the head's own, the configured ones, or EAGLE-3's default
        available = list(range(final + 1))
        layers = (config.feature_layers or (list(head.config.feature_layers) if config.init_head else None)
                  or default_feature_layers(final))
    else:
        available = list(meta["layers"]) + [final]
        layers = config.feature_layers or list(dict.fromkeys(available))
    missing = [i for i in layers if i not in available]
    if missing:
        raise ValueError(f"feature layers {missing} are not in the cached data (layers {available})")
    select = None if online else [available.index(i) for i in layers]
    collate_kw = dict(select=select, model=model, layers=layers, device=device)
    if config.init_head:
        continued_from = {"head": str(config.init_head), "training": head.config.training}
        if list(head.config.feature_layers) != layers:
            continued_from["feature_layers"] = list(head.config.feature_layers)
            head = transplant_feature_layers(head, layers, str(config.init_head))
            log(f"starting from {config.init_head}'s weights with its fusion restricted to layers {layers} "
                f"(it read {continued_from['feature_layers']})")
        if config.intermediate_size and config.intermediate_size != head.config.intermediate_size:
            continued_from["intermediate_size"] = head.config.intermediate_size
            head = widen_mlp(head, config.intermediate_size, str(config.init_head), seed=config.seed)
            log(f"starting from {config.init_head}'s weights with its MLP widened from "
                f"{continued_from['intermediate_size']} to {config.intermediate_size} (the new units start silent)")
        head.train()
    else:
        continued_from = {}
        head = EagleHead(head_config_for(model, target.name, layers, len(d2t), config.intermediate_size))
        _init_feature_norms(head, model, layers)
        head.d2t.copy_(d2t)
        if config.init_from_layer is not None:
            _init_from_target_layer(head, model, config.init_from_layer)
    head.to(device)
    head.attach(model)  # a head continued from another target's checkpoint is refused here
    head.lm_head_d = head.lm_head_d.float()
    head.embed = _FrozenEmbedding(model.get_input_embeddings().weight.detach().float())
    full_head = model.get_output_embeddings().weight.detach().float()  # [V, H], for validation beta

    settings = asdict(config) | {"feature_layers": layers, "text": text_record.get("files") or None}
    objective = _EagleObjective(head, config, val, full_head, collate_kw, out_dir, meta, coverage)
    return train_loop(objective, config, train, text, out_dir, settings, TrainReport(continued_from=continued_from),
                      rng, validate_first=bool(config.init_head), progress=progress, log=log, should_stop=should_stop)


class _EagleObjective:
    """The EAGLE head's part of ``verispec.training.loop.train_loop``: the unrolled (training-time test) soft
    cross-entropy, per-depth validation, and its folder."""

    what = "EAGLE head"

    def __init__(self, head: EagleHead, config: TrainConfig, val: list[Sequence], full_head: torch.Tensor,
                 collate_kw: dict, out_dir, meta: dict, coverage: float):
        self.module = head
        self.config, self.val, self.full_head, self.collate_kw = config, val, full_head, collate_kw
        self.out_dir, self.meta, self.coverage = out_dir, meta, coverage

    def loss(self, seqs: list[Sequence], autocast: dict):
        head, config = self.module, self.config
        batch = collate(seqs, prompt_loss=config.prompt_loss, **self.collate_kw)
        with torch.autocast(**autocast):
            states = unrolled_states(head, batch, config.ttt_steps)
        loss, weight_sum, accs = 0.0, 0.0, []
        for s, g in enumerate(states):
            mask = batch.loss_mask.clone()
            mask[:, :s] = False
            if not mask.any():
                continue
            with torch.no_grad():  # the target's distribution over the draft vocabulary
                p = torch.softmax(batch.final[:, 1:][mask].float() @ head.lm_head_d.T, dim=-1)
            with torch.autocast(**autocast):
                lg = head.logits(g[mask])  # only where there is a label: the logits dominate the cost
            logq = torch.log_softmax(lg.float(), dim=-1)
            loss = loss + (config.step_decay ** s) * -(p * logq).sum(-1).mean()
            weight_sum += config.step_decay ** s
            with torch.no_grad():  # top-1 on the answer positions among the trained ones
                scored = batch.answer_mask[mask]
                hit = head.d2t[lg.argmax(-1)] == batch.labels[mask]
                accs.append(hit[scored].float().mean().item() if scored.any() else 0.0)
        if not weight_sum:
            return None, 0, accs
        return loss / weight_sum, int(batch.loss_mask.sum()), accs

    def validate(self) -> dict:
        return validate(self.module, self.val, self.config, self.full_head, **self.collate_kw)

    def describe(self, metrics: dict) -> str:
        return _format_metrics(metrics)

    def save(self, report: TrainReport) -> None:
        _save(self.module, self.out_dir, self.meta, self.config, report, self.coverage)

    def record(self, report: TrainReport) -> None:
        if (Path(self.out_dir) / WEIGHTS).exists():
            _save_training_record(self.out_dir, self.meta, self.config, report, self.coverage)


class _FrozenEmbedding(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def transplant_feature_layers(head: EagleHead, layers: list[int], source: str = "the head") -> EagleHead:
    """A head reading ``layers``, a subset of ``head``'s feature layers, started from ``head``: every weight kept,
    the fusion restricted to the kept layers' columns (the fused feature is normed before use, so dropping the other
    layers' terms changes its direction, not its scale). This starts a head for llama.cpp's callback-free final state
    (``--layers 30``) from the shipped four-layer one."""
    old = list(head.config.feature_layers)
    extra = [i for i in layers if i not in old]
    if extra:
        raise ValueError(f"{source} reads target layers {old}, and this training adds {extra}; continue with a "
                         "subset of its layers or start afresh")
    keep = [old.index(i) for i in layers]
    config = HeadConfig(**{**asdict(head.config), "feature_layers": list(layers)})
    new = EagleHead(config)
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("embed.")}  # the target's, borrowed
    h = config.hidden_size
    state["fuse.weight"] = torch.cat([state["fuse.weight"][:, j * h:(j + 1) * h] for j in keep], dim=1)
    for name in [k for k in state if k.startswith("feature_layer_norms.")]:
        del state[name]
    for new_index, j in enumerate(keep):
        state[f"feature_layer_norms.{new_index}.weight"] = head.feature_layer_norms[j].weight.detach()
    new.load_state_dict(state)
    return new.to(next(head.parameters()).dtype)


def widen_mlp(head: EagleHead, size: int, source: str = "the head", seed: int = 0) -> EagleHead:
    """A head whose MLP has ``size`` hidden units, started from ``head``: every weight kept, the new units' gate and
    up rows drawn small and their down-projection columns zero, so the new head computes exactly what ``head`` does
    until training moves them (more capacity, same starting point; Net2Net's function-preserving widening)."""
    old = head.config.intermediate_size
    if size < old:
        raise ValueError(f"{source} has an MLP of {old} units; widening needs --intermediate-size of at least that, "
                         f"got {size} (a narrower head trains afresh)")
    config = HeadConfig(**{**asdict(head.config), "intermediate_size": size})
    new = EagleHead(config)
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("embed.")}  # the target's, borrowed
    generator = torch.Generator().manual_seed(seed)
    std = float(state["gate_proj.weight"].float().std())
    for name in ("gate_proj.weight", "up_proj.weight"):
        w = state[name]
        fresh = torch.randn(size - old, w.shape[1], generator=generator) * std
        state[name] = torch.cat([w, fresh.to(w.dtype)], dim=0)
    down = state["down_proj.weight"]
    state["down_proj.weight"] = torch.cat([down, down.new_zeros(down.shape[0], size - old)], dim=1)
    new.load_state_dict(state)
    return new.to(next(head.parameters()).dtype)


def _init_feature_norms(head: EagleHead, model, layers: list[int]) -> None:
    """hidden_states[l] is the input of decoder layer l, so start its norm from that layer's input norm (the
    target's own way of taming the massive dimensions); the final state is normed already."""
    with torch.no_grad():
        for norm, index in zip(head.feature_layer_norms, layers):
            if index < model.config.num_hidden_layers:
                norm.weight.copy_(model.model.layers[index].input_layernorm.weight.float())


def _init_from_target_layer(head: EagleHead, model, index: int) -> None:
    """Start the decoder layer from one of the target's (same shapes), which trains faster than random."""
    layers = model.model.layers
    layer = layers[index]
    pairs = {
        "attn_norm.weight": layer.input_layernorm.weight, "mlp_norm.weight": layer.post_attention_layernorm.weight,
        "q_proj.weight": layer.self_attn.q_proj.weight, "k_proj.weight": layer.self_attn.k_proj.weight,
        "v_proj.weight": layer.self_attn.v_proj.weight, "o_proj.weight": layer.self_attn.o_proj.weight,
        "gate_proj.weight": layer.mlp.gate_proj.weight, "up_proj.weight": layer.mlp.up_proj.weight,
        "down_proj.weight": layer.mlp.down_proj.weight, "out_norm.weight": model.model.norm.weight,
    }
    state = head.state_dict()
    with torch.no_grad():
        for name, weight in pairs.items():
            if state[name].shape == weight.shape:
                state[name].copy_(weight.float())


@torch.no_grad()
def validate(head: EagleHead, sequences: list[Sequence], config: TrainConfig, full_head: torch.Tensor,
             select: list[int] | None = None, model=None, layers: list[int] | None = None,
             device: str | torch.device = "cpu") -> dict:
    """Teacher-forced validation per draft depth: top-1 agreement with the target's own next token, and
    beta = sum min(p, q) at temperature 1 over the full vocabulary (q is zero outside the draft vocabulary)."""
    head.eval()
    hits = [0] * config.ttt_steps
    betas = [0.0] * config.ttt_steps
    count = [0] * config.ttt_steps
    device = torch.device(device)
    for seqs in make_batches(sequences, config.batch_tokens, random.Random(0)):
        batch = collate(seqs, select, model=model, layers=layers, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16_autocast):
            states = unrolled_states(head, batch, config.ttt_steps)
        first = batch.answer_mask
        p = torch.softmax(batch.final[:, 1:][first].float() @ full_head.T, dim=-1)  # [n, V], shared by all depths
        for s, g in enumerate(states):
            mask = first.clone()
            mask[:, :s] = False
            rows = mask[first]  # which of p's rows depth s is scored on
            lg = head.logits(g[mask].float())
            label = batch.labels[mask]
            hits[s] += int((head.d2t[lg.argmax(-1)] == label).sum())
            q = torch.softmax(lg, dim=-1)
            betas[s] += float(torch.minimum(p[rows][:, head.d2t], q).sum())
            count[s] += int(mask.sum())
    head.train()
    top1 = [h / max(1, c) for h, c in zip(hits, count)]
    beta = [b / max(1, c) for b, c in zip(betas, count)]
    # greedy tokens per step if depth s is right with probability top1[s] given the earlier depths were right
    # (deeper depths reuse the last measured one), for a chain of 6 draft tokens
    est, run = 1.0, 1.0
    for d in range(6):
        run *= top1[min(d, len(top1) - 1)]
        est += run
    return {"top1": [round(a, 4) for a in top1], "beta": [round(b, 4) for b in beta],
            "est_tokens_per_step": round(est, 3)}


def _format_metrics(m: dict) -> str:
    return (f"step {m['step']} (epoch {m['epoch']}, {m['seconds']:.0f} s): top-1 by depth "
            f"{' / '.join(f'{a:.3f}' for a in m['top1'])}, beta {' / '.join(f'{b:.3f}' for b in m['beta'])}, "
            f"est. greedy tokens/step at k=6 {m['est_tokens_per_step']:.2f}")


def _save(head: EagleHead, out_dir, meta: dict, config: TrainConfig, report: TrainReport, coverage: float) -> None:
    head.config.training = training_record(meta, config, report, coverage)
    head.save(out_dir)


def _save_training_record(out_dir, meta, config, report, coverage) -> None:
    folder = Path(out_dir)
    cfg = HeadConfig.load(folder)
    cfg.training = training_record(meta, config, report, coverage)
    cfg.save(folder)
