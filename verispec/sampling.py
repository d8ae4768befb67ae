"""From logits to the probabilities the acceptance rule compares.

Target and drafter go through the same function with the same parameters, so p and q are
distributions over the same processed space. Temperature 0 is greedy decoding, represented as a
one-hot distribution on the argmax: the strict rejection rule then reduces to "accept while the
draft token is the argmax" without a separate code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidRequest, check_whole


# below this temperature sampling is the argmax (ties shared): e^(-d / T) is 0 in float32 for any logit gap d that
# float32 can tell from 0 at the logits' scale
TINY_TEMPERATURE = 1e-20


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from logits. ``top_k=0`` and ``top_p=1.0`` switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature:
            raise InvalidRequest(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise InvalidRequest(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}; pass 0 for greedy "
                "decoding or a positive value to sample"
            )
        check_whole("top_k", self.top_k, 0, note="0 turns it off")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` ([rows, vocab]; the first of tied maxima, as ``torch.argmax``). Float
    rows on the CPU go through numpy, whose argmax over a large vocabulary is an order of magnitude cheaper than
    torch's on one thread: a greedy step reads it once per pass (docs/kernels.md)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed next-token distribution for each row of ``logits`` ([..., vocab] -> [..., vocab], float32)."""
    logits = logits.float()
    if params.greedy:
        index = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, index, 1.0)
    top = logits.max(dim=-1, keepdim=True).values
    if params.temperature < TINY_TEMPERATURE:
        # the limit T -> 0: the largest logits share the mass (dividing would overflow float32, or divide by a
        # temperature that rounds to 0 in float32, and softmax would return NaN)
        ties = (logits == top).float()
        return ties / ties.sum(dim=-1, keepdim=True)
    logits = (logits - top) / params.temperature  # shifted first: the largest is 0, the rest stay finite or -inf
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # keep the smallest head of the sorted list whose mass reaches top_p; the first token always stays, also
        # when top_p rounds to 0 in float32 (e.g. 1e-158), where "mass before >= top_p" would drop it too
        drop = mass_before >= params.top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D distribution (any non-negative weights) with one uniform number from
    ``generator`` (``sample_at``). A draw is one cumulative sum and one binary search, where
    ``torch.multinomial`` costs a noticeable share of a small model's decoding step (docs/kernels.md)."""
    return sample_at(probs, float(torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)))


def sample_at(probs: torch.Tensor, u: float) -> int:
    """The token id whose share of the cumulative mass holds ``u`` in [0, 1): the first id whose cumulative mass
    exceeds u * total (the inverse CDF). The sums are float64, and an id with zero probability can never be drawn
    (its cumulative mass equals its predecessor's). A one-hot distribution always gives its index."""
    cdf = torch.cumsum(probs.detach(), 0, dtype=torch.float64)  # accumulates in float64 without a converted copy
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), probs.numel() - 1)


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers whose outputs look independent for nearby inputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) of one sequence position under one seed: a hash of both, so the draw that
    decides the token at a position does not depend on how many draws came before it (drafts, their length, the
    batch). Each (seed, position) pair gets its own value; distinct pairs look independent."""
    h = _mix64((seed * 0x9E3779B97F4A7C15 + _mix64(position + 0x632BE59BD9B4E019)) & _MASK64)
    return (h >> 11) * 2.0**-53
