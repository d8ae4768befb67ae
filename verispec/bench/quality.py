"""What a weight format does to the model: teacher-forced perplexity on held-out text, and how often its top-1 token
agrees with the model's own weights.

A speed measured on a changed model is not a like-for-like win (a re-quantized model that loops more is drafted
more easily), so ``verispec bench`` reports every format's speed beside these two figures (``--no-quality`` skips
them). The held-out text is Spec-Bench's first turns (never trained on), fed raw, without a chat template, in
pieces of at most ``max_tokens`` tokens; each piece starts a fresh cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Quality:
    """One format's figures on the held-out text: ``perplexity`` (exp of the mean negative log-likelihood of each
    next token), ``top1_agreement`` (share of positions whose argmax equals the reference's; None without a
    reference), ``tokens`` scored."""

    perplexity: float
    top1_agreement: float | None
    tokens: int

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        agree = "" if self.top1_agreement is None else f", top-1 agreement {100 * self.top1_agreement:.2f}%"
        return f"perplexity {self.perplexity:.3f}{agree} ({self.tokens} tokens)"


def held_out_texts(count: int = 12) -> list[str]:
    """``count`` Spec-Bench first turns, spread over its six groups (the same ones every run)."""
    from .prompts import load_questions

    questions = load_questions()
    by_group: dict[str, list[str]] = {}
    for q in questions:
        by_group.setdefault(q.group, []).append(q.turns[0])
    groups = sorted(by_group)
    texts = []
    for i in range(count):
        group = by_group[groups[i % len(groups)]]
        texts.append(group[(i // len(groups)) * 7 % len(group)])
    return texts


def pieces(tokenizer, texts: list[str], max_tokens: int = 256) -> list[list[int]]:
    """The texts as token ids (no special tokens), each cut to ``max_tokens``; pieces under 8 tokens are dropped."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= 8:
            out.append(ids)
    return out


def teacher_forced(target, ids: list[int]) -> torch.Tensor:
    """The target's logits at every position of ``ids`` [len(ids), vocab], float32, from one fresh cache."""
    kv = target.new_kv()
    try:
        return target.forward(kv, ids).logits.float()
    finally:
        kv.close()


def measure(target, token_pieces: list[list[int]], reference: list[torch.Tensor] | None = None
            ) -> tuple[Quality, list[torch.Tensor]]:
    """``target``'s Quality on ``token_pieces``, and the argmax at every position (pass it as ``reference`` to compare
    another format with this one)."""
    nll, scored, agree, tops = 0.0, 0, 0, []
    for i, ids in enumerate(token_pieces):
        logits = teacher_forced(target, ids)  # [n, vocab]
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        nll -= logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum().item()
        scored += len(ids) - 1
        top = logits.argmax(dim=-1)
        tops.append(top)
        if reference is not None:
            agree += int((top == reference[i]).sum())
    positions = sum(len(ids) for ids in token_pieces)
    return Quality(math.exp(nll / scored), None if reference is None else agree / positions, scored), tops


LOOP_WINDOW = 64  # the answer's last tokens a loop is looked for in
LOOP_NGRAM = 6
LOOP_SHARE = 0.5


def loops(token_ids: list[int], window: int = LOOP_WINDOW, n: int = LOOP_NGRAM, share: float = LOOP_SHARE) -> bool:
    """Whether an answer ends stuck in a repetition loop: at least ``share`` of the ``n``-grams among its last
    ``window`` tokens occurred earlier in that window ("... is a marvel of nature's wonders, is a marvel of nature's
    wonders, ..."). Answers shorter than the window are never counted. Loops are what drafts accept best, so a
    format that loops more looks faster: the bench counts them beside every speed."""
    tail = token_ids[-window:]
    if len(tail) < window:
        return False
    seen, repeated = set(), 0
    for i in range(len(tail) - n + 1):
        gram = tuple(tail[i:i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated >= share * (len(tail) - n + 1)
