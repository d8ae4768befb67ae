"""Choosing the layers a self-speculative draft skips, by measurement on the target (no training).

Score of a skip set: the speedup over plain decoding that the geometric model predicts (``verispec.analysis``) from

- alpha, the share of positions where the view's greedy token equals the target's, teacher-forced over the target's
  own greedy answers to a few built-in prompts (one pass of the view per candidate over all of them; for greedy
  drafts this is exactly the chance that a draft position is accepted after the previous ones were), and
- c, the cost of a view's one-token step relative to the target's, from timed steps of the whole model and of a view
  with half its layers (a step costs a fixed part plus a part per layer), and the measured cost of a 5-token verify.

The search is greedy backward elimination, as in Draft & Verify: start from every layer and each round drop the layer
whose loss costs the least agreement (layer 0 and the last layer stay), for up to ``max_rounds`` rounds, until the
agreement falls below ``floor`` or the score has fallen twice in a row below 1; the best-scoring set on the way wins. The result is stored with the target's
other measurements (``verispec.backends.measurements``), so the search runs once per model, dtype, CPU and version.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..analysis import expected_tokens_geometric, interpolate
from ..backends import measurements
from ..backends.timing import time_passes
from ..errors import InvalidRequest

log = logging.getLogger(__name__)

KIND = "layerskip"
SEARCH = 1  # bump when the search changes: earlier stored choices are then a different key
# calibration prompts written for verispec (never benchmark prompts): a spread of what chat models are asked
PROMPTS = (
    "Explain in a few sentences why the sky looks blue during the day and red at sunset.",
    "Write a short Python function that returns the n-th Fibonacci number, with a docstring.",
    "List five tips for keeping a small vegetable garden healthy through a dry summer.",
    "Summarize the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "What is the difference between a list and a tuple in Python? Give an example of each.",
    "Translate into French: The train to the coast leaves every morning at eight o'clock.",
    "A shop sells pencils at 3 for 2 dollars. How much do 12 pencils cost? Show your steps.",
    "Write an email to a colleague asking to move tomorrow's meeting to Friday afternoon.",
)


@dataclass
class Choice:
    skip: tuple[int, ...]
    agreement: float  # alpha: greedy agreement with the target, teacher-forced
    cost_ratio: float  # c: the view's one-token step over the target's
    predicted_speedup: float  # best over k of E(k) / (k c + r(k))
    k: int  # the draft length that reaches it


@dataclass
class Calibration:
    """The chosen skip set (``skip`` and its scores) and every set the search scored on the way (``path``)."""

    skip: tuple[int, ...]
    agreement: float
    cost_ratio: float
    predicted_speedup: float
    k: int
    layers: int
    seconds: float
    path: list[Choice] = field(default_factory=list)

    def describe(self) -> str:
        return (f"skip layers {format_layers(self.skip)} of {self.layers}: agreement {self.agreement:.2f}, draft step "
                f"{self.cost_ratio:.2f}x a target step, predicted {self.predicted_speedup:.2f}x plain at k={self.k}")

    @classmethod
    def from_record(cls, value: dict) -> "Calibration":
        path = [Choice(tuple(c["skip"]), c["agreement"], c["cost_ratio"], c["predicted_speedup"], c["k"])
                for c in value.get("path", [])]
        return cls(**{**value, "skip": tuple(value["skip"]), "path": path})


def parse_skip(value: str | Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Layers to skip from "3,5-8" or "3+5-8" (or a sequence of ints), checked: within range, never layer 0 (the first layer
    holds the positions the cache length is read from) and never all of them."""
    if isinstance(value, str):
        found: set[int] = set()
        for part in filter(None, (p.strip() for p in value.replace("+", ",").split(","))):
            lo, _, hi = part.partition("-")
            try:
                first, last = int(lo), int(hi) if hi else int(lo)
            except ValueError:
                raise InvalidRequest(f"layers to skip are given as numbers and ranges like 10,12-14, not {value!r}"
                                     ) from None
            found.update(range(first, last + 1))
        skip = tuple(sorted(found))
    else:
        skip = tuple(sorted({int(i) for i in value}))
    if not skip:
        raise InvalidRequest("no layers to skip were given: name some (e.g. 10,12-14) or use 'auto'")
    bad = [i for i in skip if not 0 < i < num_layers]
    if bad:
        raise InvalidRequest(f"cannot skip layer(s) {bad}: this target has layers 0-{num_layers - 1}, and layer 0 "
                             "is always kept")
    return skip


def format_layers(layers: Sequence[int]) -> str:
    """(3, 5, 6, 7, 8) -> "3,5-8"."""
    parts, run = [], []
    for i in sorted(layers):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def predicted_speedup(alpha: float, c: float, verify_cost, max_k: int = 8) -> tuple[float, int]:
    """(best predicted speedup, its k) for per-position acceptance ``alpha`` and draft cost ratio ``c``."""
    best = max((expected_tokens_geometric(alpha, k) / (k * c + verify_cost(k)), k) for k in range(1, max_k + 1))
    return best


def answers(target, prompts=PROMPTS, new_tokens: int = 48) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy answer ids) for each prompt (chat template applied where there is one)."""
    tok = target.tokenizer
    found = []
    for prompt in prompts:
        if tok.chat_template:
            ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"])
        else:
            ids = list(tok(prompt, add_special_tokens=True)["input_ids"])
        kv = target.new_kv()
        token = int(target.forward(kv, ids, last_only=True).logits[-1].argmax())
        answer = [token]
        while len(answer) < new_tokens and token not in target.eos_token_ids:
            token = int(target.forward(kv, [token]).logits[-1].argmax())
            answer.append(token)
        kv.close()
        found.append((ids, answer))
    return found


def agreement(model: torch.nn.Module, sequences, pad: int = 0) -> float:
    """Share of answer positions where ``model``'s argmax (teacher-forced, one padded batch) is the answer token."""
    width = max(len(p) + len(a) for p, a in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    for row, (p, a) in enumerate(sequences):
        ids[row, : len(p) + len(a)] = torch.tensor(p + a)  # right padding: causal positions before it are unchanged
    logits = model(input_ids=ids, use_cache=False).logits
    hits = total = 0
    for row, (p, a) in enumerate(sequences):
        predicted = logits[row, len(p) - 1 : len(p) + len(a) - 1].argmax(-1)
        hits += int((predicted == torch.tensor(a)).sum())
        total += len(a)
    return hits / total


@torch.inference_mode()
def calibrate(target, *, prompts=PROMPTS, new_tokens: int = 48, max_rounds: int = 8, floor: float = 0.3,
              progress: bool = True) -> Calibration:
    """Search the skip set for ``target`` (a transformers ``LoadedModel``); see the module docstring."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    layers = target.num_layers
    if layers < 3:
        raise InvalidRequest(f"layer skipping needs a target with at least 3 decoder layers (the first and last are "
                             f"kept), {target.name} has {layers}: use another drafter")
    sequences = answers(target, prompts, new_tokens)
    pad = target.tokenizer.pad_token_id or 0
    # step costs: a fixed part plus a part per layer, from the whole model and a view with half its layers
    full = time_passes(target, 128, (1, 5), repeats=7)
    half = target.without_layers(range(1, layers // 2 + 1))
    half_ms = time_passes(half, 128, (1,), repeats=7)[1]
    # timings are noisy: a layer never costs more than an equal share of the whole step (else a view without it
    # would be priced above the full model), nor less than nothing
    per_layer = min(max(full[1] - half_ms, 0.0) / (layers // 2), full[1] / layers)
    fixed = full[1] - per_layer * layers
    verify_cost = interpolate({0: 1.0, 4: full[5] / full[1]})

    def score(skip: tuple[int, ...], alpha: float) -> Choice:
        c = (fixed + per_layer * (layers - len(skip))) / full[1]
        speedup, k = predicted_speedup(alpha, c, verify_cost)
        return Choice(skip, alpha, c, speedup, k)

    path: list[Choice] = []
    current: tuple[int, ...] = ()
    rounds = min(max_rounds, layers - 2)
    bar = tqdm(total=sum(layers - 2 - r for r in range(rounds)), desc="layerskip: choosing layers", unit="set",
               disable=not progress, leave=False)
    for _ in range(rounds):
        tried = []
        for i in range(1, layers - 1):
            if i in current:
                continue
            skip = tuple(sorted(current + (i,)))
            tried.append((agreement(target.without_layers(skip).model, sequences, pad), skip))
            bar.update(1)
        alpha, current = max(tried)
        path.append(score(current, alpha))
        log.debug("layerskip search: %s", path[-1])
        falling = len(path) >= 3 and path[-1].predicted_speedup < path[-2].predicted_speedup < path[-3].predicted_speedup
        if alpha < floor or (falling and path[-1].predicted_speedup < 1.0):
            break  # agreement is gone, or the score has fallen twice in a row below plain decoding
    bar.close()
    best = max(path, key=lambda c: c.predicted_speedup)
    result = Calibration(best.skip, best.agreement, best.cost_ratio, best.predicted_speedup, best.k, layers,
                         round(time.perf_counter() - start, 1), path)
    log.info("layerskip for %s, measured in %.0f s: %s", target.name, result.seconds, result.describe())
    if best.predicted_speedup <= 1.0:
        log.warning("layer skipping is not predicted to pay on %s (best: skip %s, agreement %.2f at %.2fx the cost "
                    "of a step); the controller will mostly decode plainly", target.name, format_layers(best.skip),
                    best.agreement, best.cost_ratio)
    return result


def calibrated(target, *, progress: bool = True) -> Calibration:
    """The stored choice for this target, or a new search (stored for next time)."""
    key = target.measurement_key
    key = None if key is None else {**key, "search": SEARCH, "prompts": len(PROMPTS)}
    stored = measurements.load(KIND, key)
    if stored is not None:
        try:
            return Calibration.from_record(stored)
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring an unreadable stored layerskip choice; measuring again")
    log.warning("choosing which layers of %s to skip by measurement (once; about a minute on 2 cores) ...",
                target.name)
    result = calibrate(target, progress=progress)
    measurements.save(KIND, key, asdict(result))
    return result
