"""Statistical audit of losslessness: does speculative sampling follow the target's exact distribution?

Method. Draw N continuations of M tokens with speculation (seeds seed..seed+N-1). For every sample s and
position j, compute the target's exact processed distribution p_{s,j} = p(. | prompt, x_{s,<j}) by
teacher forcing. Under the null hypothesis (lossless), x_{s,j} ~ p_{s,j} independently given its prefix,
so at position j the observed token counts O(x) have expectation E(x) = sum_s p_{s,j}(x). Pearson's
chi-square compares O with E after pooling tokens whose expected count is below ``min_expected`` into
one cell. Position 1 shares one prefix, so its test is the textbook goodness-of-fit; at later positions
the prefixes differ and the statistic is, if anything, conservative (a sum of non-identical categoricals
varies less than a multinomial). A token observed where the target gives it probability 0 fails at once.
The verdict applies Bonferroni over the M positions: pass when every p-value >= alpha / M.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
from scipy.stats import chi2

from .engine import SpeculativeDecoder
from .errors import InvalidRequest
from .sampling import SamplingParams, probabilities


@dataclass
class PositionTest:
    position: int
    samples: int
    statistic: float
    dof: int
    p_value: float
    cells: int
    impossible: int = 0  # samples whose token had target probability 0


@dataclass
class AuditReport:
    drafter: str
    acceptance: str
    lossy: bool
    temperature: float
    top_k: int
    top_p: float
    samples: int
    alpha: float
    positions: list[PositionTest] = field(default_factory=list)
    # how much speculation the samples exercised (a drafter that never drafted leaves plain decoding audited)
    steps: int = 0
    draft_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def threshold(self) -> float:
        return self.alpha / max(1, len(self.positions))

    @property
    def passed(self) -> bool:
        return all(t.p_value >= self.threshold for t in self.positions)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(threshold=self.threshold, passed=self.passed, verdict=self.verdict)
        return out


def chi_square(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float, int]:
    """Pearson goodness of fit with rare cells pooled. Returns (statistic, dof, p_value, cells).
    ``observed`` and ``expected`` are counts over the same categories and sum to the same total."""
    observed = observed.double()
    expected = expected.double()
    impossible = (expected <= 0) & (observed > 0)
    if bool(impossible.any()):
        return float("inf"), 0, 0.0, int(observed.numel())
    common = expected >= min_expected
    obs = observed[common].tolist()
    exp = expected[common].tolist()
    rare_o, rare_e = float(observed[~common].sum()), float(expected[~common].sum())
    if rare_e > 0:
        if rare_e < min_expected and exp:
            # the pooled cell is still small: fold it into the smallest common cell
            i = min(range(len(exp)), key=exp.__getitem__)
            obs[i] += rare_o
            exp[i] += rare_e
        else:
            obs.append(rare_o)
            exp.append(rare_e)
    cells = len(exp)
    if cells < 2:
        return 0.0, 0, 1.0, cells
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = cells - 1
    return stat, dof, float(chi2.sf(stat, dof)), cells


class TeacherForcer:
    """Exact target distributions after a fixed prompt, for any continuation (prompt prefilled once). Samples often
    repeat a continuation (low temperatures, formulaic prompts): the distributions of the most recent ones are kept
    (up to ``memo_bytes``), so a repeat costs no pass."""

    def __init__(self, target, prompt_ids: list[int], sampling: SamplingParams, memo_bytes: int = 64 << 20):
        self.target, self.prompt_ids, self.sampling = target, list(prompt_ids), sampling
        self.cache = target.new_kv()
        self.memo: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self.memo_bytes, self.held = memo_bytes, 0
        self.passes = 0  # target passes run (repeats answered from the memo are not)
        if len(prompt_ids) > 1:
            with torch.inference_mode():
                target.forward(self.cache, prompt_ids[:-1], last_only=True)

    @torch.inference_mode()
    def distributions(self, continuation: Sequence[int]) -> torch.Tensor:
        """p(. | prompt, continuation[:j]) for j = 0..len-1, processed as the engine does ([len, vocab])."""
        key = tuple(int(t) for t in continuation)
        if (p := self.memo.get(key)) is not None:
            self.memo.move_to_end(key)
            return p
        feed = [self.prompt_ids[-1], *continuation[:-1]]
        logits = self.target.forward(self.cache, feed).logits
        self.cache.truncate(len(self.prompt_ids) - 1)
        self.passes += 1
        p = probabilities(logits, self.sampling)
        self.memo[key] = p
        self.held += p.numel() * p.element_size()
        while self.held > self.memo_bytes and len(self.memo) > 1:
            _, dropped = self.memo.popitem(last=False)
            self.held -= dropped.numel() * dropped.element_size()
        return p


def run_audit(
    decoder: SpeculativeDecoder,
    prompt_ids: list[int],
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    samples: int = 400,
    positions: int = 3,
    seed: int = 0,
    alpha: float = 0.01,
    min_expected: float = 5.0,
    progress: Callable[[int], None] | None = None,
    sampler: Callable[[list[int], list[int], dict], list] | None = None,
) -> AuditReport:
    """Sample ``samples`` continuations of ``positions`` tokens and test each position (see module doc).
    ``sampler(prompt_ids, seeds, options)`` draws the samples (a list of Generations, one per seed) when they
    should come from somewhere else than ``decoder.generate`` one by one, e.g. inside a busy batch."""
    if samples < 10:
        raise InvalidRequest(f"samples must be >= 10 for a meaningful test, got {samples}")
    if positions < 1:
        raise InvalidRequest(f"positions must be >= 1, got {positions}")
    if not 0 < alpha < 1:
        raise InvalidRequest(f"alpha must be in (0, 1), got {alpha}")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    vocab = decoder.target.vocab_size
    observed = torch.zeros(positions, vocab, dtype=torch.float64)
    expected = torch.zeros(positions, vocab, dtype=torch.float64)
    counts = [0] * positions
    eos = decoder.target.eos_token_ids
    forcer = TeacherForcer(decoder.target, prompt_ids, sampling)
    steps = draft_steps = drafted = accepted = 0
    options = dict(max_new_tokens=positions, temperature=temperature, top_k=top_k, top_p=top_p)
    drawn = sampler(list(prompt_ids), [seed + s for s in range(samples)], options) if sampler else None
    for s in range(samples):
        g = drawn[s] if drawn is not None else decoder.generate(prompt_ids, seed=seed + s, **options)
        tokens = g.token_ids
        steps += g.stats.verify_steps
        draft_steps += g.stats.drafts
        drafted += g.stats.drafted
        accepted += g.stats.accepted
        p = forcer.distributions(tokens)  # [len(tokens), vocab]
        for j, token in enumerate(tokens):
            observed[j, token] += 1
            expected[j] += p[j].double()
            counts[j] += 1
            if token in eos:
                break
        if progress:
            progress(s + 1)
    report = AuditReport(
        drafter=decoder.drafter_name, acceptance=decoder.acceptance, lossy=decoder.lossy, temperature=temperature,
        top_k=top_k, top_p=top_p, samples=samples, alpha=alpha, steps=steps, draft_steps=draft_steps,
        drafted=drafted, accepted=accepted,
    )
    for j in range(positions):
        if counts[j] == 0:
            continue
        stat, dof, pval, cells = chi_square(observed[j], expected[j], min_expected)
        impossible = int(observed[j][expected[j] <= 0].sum())
        report.positions.append(PositionTest(j + 1, counts[j], stat, dof, pval, cells, impossible))
    return report
