"""How many draft tokens to verify each step (0 included), chosen from costs and acceptance measured online.

A step that verifies n draft tokens commits, in expectation, ``1 + sum_{i<=n} prod_{j<=i} a_j`` tokens, where
a_j is the chance that draft position j is accepted given that j-1 were, and costs the drafter's time for the
draft plus a target pass over (fed + n) tokens. The controller picks the n with the most expected tokens per
second and compares it with a plain step (n = 0: no drafting work at all, one token per pass). Nothing here is
tuned to a machine: the cost of a pass is measured per width on the machine that runs it, acceptance per
position on the text being generated.

Two decisions per step:

1. ``draft_budget`` before drafting: how many tokens to ask the drafter for (0 = a plain step). Uses the
   acceptance by position of this request (seeded by the drafter's history) and both costs.
2. ``verify_length`` after drafting: how many of the proposed tokens to verify. The drafting cost is spent; a
   drafter may attach a confidence to each position, which the controller turns into an acceptance estimate
   through a calibration table it keeps against what the target really accepted.

Lossless by construction: for drafts sampled from q the decision to verify position i may use the confidences of
positions 1..i only, and a drafter's confidence at i must be a function of the distribution q_i it sampled from
(e.g. its largest probability), never of the sampled token itself (choosing which sampled tokens to verify by
their own value would bias them). The decision is a stopping rule over i, so strict rejection sampling still
returns the target's distribution. Deterministic drafts (n-gram, greedy) may use every confidence at once.

Exploration: when the rule says "plain", a small draft is still verified now and then (``probe``) so that a turn
of the text towards something predictable is noticed; the interval doubles after each failed probe (up to
``max_probe_interval``) and resets after a successful one. And each plain step moves the request's acceptance
estimate a little (``plain_relax``) back towards the drafter's long-run acceptance (its last several hundred
drafts, across requests), so a few unlucky drafts early in an answer no longer keep a drafter that pays on the rest
of it in plain steps for the whole answer (with the EAGLE head one Spec-Bench answer had run 114 of 123 steps plain
at 1.04 tokens per step, where a fixed k = 3 committed 2.46). Switching between plain and speculative steps needs a
``margin`` of predicted gain (hysteresis), so near-ties do not flap.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable

from .analysis import expected_tokens, expected_tokens_by_length
from .backends import measurements
from .errors import InvalidRequest

log = logging.getLogger(__name__)

FIXED, COST = "fixed", "cost"
K_POLICIES = (COST, FIXED)


class RunningMean:
    """A mean of the first observations that turns into an exponential moving average (weight ``smoothing``)
    once it has seen about 1/smoothing of them; starts from ``prior`` counted as ``weight`` observations."""

    __slots__ = ("value", "count", "smoothing")

    def __init__(self, prior: float, weight: float = 1.0, smoothing: float = 0.1) -> None:
        self.value, self.count, self.smoothing = float(prior), float(weight), smoothing

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) * max(1.0 / self.count, self.smoothing)

    def copy(self, max_weight: float | None = None) -> "RunningMean":
        weight = self.count if max_weight is None else min(self.count, max_weight)
        return RunningMean(self.value, weight, self.smoothing)


class CostCurve:
    """Seconds of one engine step over ``width`` tokens (target pass, probabilities, rollback).

    A running mean per measured width. Width 1 is read as measured (a one-token pass often takes a different
    kernel path than any wider one); wider widths are read from a straight line fitted to the measured widths
    from 2 up (Theil-Sen: weighted medians of the pairwise slopes and of the intercepts, each width weighted by how
    often it was measured, at most 20), so that one noisy width does not bend the curve; never below the one-token
    time. With one wider width measured, the line goes through it and width 1; with none, the extra tokens are
    assumed to cost ``prior_slope`` of a one-token pass each (an optimistic start that the first measurements
    correct).

    A curve may start from one an earlier process measured on the same machine (``seed``): those widths count as
    ``SEED_WEIGHT`` observations, so this process's own measurements soon outweigh them, and once ``STALE_AFTER``
    live measurements at a seeded width disagree with it by more than the noise band (``STALE_FACTOR``, or wider when
    those measurements themselves spread further: a busy machine), that width alone is dropped and measured again
    (with the widths of this process's own calibration, timed in the same moment; the stored ones stay until their
    own steps judge them: a machine that was busy for one width's steps no longer throws the whole stored curve away,
    which had made every later one-shot process calibrate again).

    A seeded width this process has not confirmed can never make a pass look dearer than this process's own
    measurements say: once it has timed two widths itself, a pass costs the lower of the seeded line and the line
    through its own widths. Otherwise a stored curve that once measured wide passes under load (3.6x a step at
    width 3, where they cost 1.2x) kept the controller at its narrowest draft, which never timed a wide pass again
    to find the seed stale, in this process and in every later one that read the curve back.

    What is stored again (``stored``): the widths this process measured or confirmed, and, for at most ``MAX_AGE``
    processes in a row, the stored widths it never timed (their age counted in the record: ``unconfirmed``). A
    process whose controller runs narrow passes only thus passes on the wide widths it inherited, and the next
    one-shot process does not calibrate them again (that re-measurement had been 7-14% of a one-shot `generate`'s
    wall time); a width nobody has timed for ``MAX_AGE`` processes is dropped and timed afresh.

    The engine's calibration (a few passes timed at the first request) enters the same way (``seed(...,
    stored=False)``): a load on the machine during those few passes had locked a whole run into one-token drafts
    (1.31x plain with 1.51 tokens a step, against 1.53x and 2.20 in the next run), since the wide widths it timed
    were never timed again. Calibrated widths are stored for the next process; stored ones it never confirmed are
    not."""

    SEED_WEIGHT = 2.0
    STALE_AFTER = 3
    STALE_FACTOR = 1.5
    MAX_AGE = 8  # processes in a row that may pass on a stored width without timing it

    def __init__(self, smoothing: float = 0.1, prior_slope: float = 0.1) -> None:
        self.smoothing = smoothing
        self.prior_slope = prior_slope
        self._means: dict[int, RunningMean] = {}
        self._line: tuple[float, float, float, float] | None = None
        self._live_line: tuple[float, float, float, float] | None = None
        self._seeded: dict[int, float] = {}  # width -> the stored value it started from
        self._from_store: set[int] = set()  # seeded widths read from an earlier process (not this one's calibration)
        self._ages: dict[int, int] = {}  # stored widths: how many processes in a row passed them on untimed
        self._live: dict[int, list[float]] = {}  # this process's first measurements at seeded widths
        self.changed = False  # measured since it was last stored
        self.key: dict | None = None  # what it is stored under (shared_cost_curve); None: never stored
        self.saved_at = 0.0

    def observe(self, width: int, seconds: float) -> None:
        self._line = self._live_line = None
        self.changed = True
        if width in self._seeded and self._check_seed(width, seconds):
            return
        mean = self._means.get(width)
        if mean is None:
            self._means[width] = RunningMean(seconds, 1.0, self.smoothing)
        else:
            mean.add(min(seconds, 3 * mean.value))  # one stall (a page fault, another process) is not the curve

    def seed(self, measured: dict[int, float], stored: bool = True, ages: dict[int, int] | None = None) -> None:
        """Start from ``measured`` (width -> seconds): an earlier process's curve (``ages``: how many processes
        had passed each width on without timing it), or with ``stored=False`` this process's calibration; either is
        provisional until live steps confirm it (see the class docstring)."""
        for width, seconds in measured.items():
            if int(width) >= 1 and float(seconds) > 0:
                self._means[int(width)] = RunningMean(float(seconds), self.SEED_WEIGHT, self.smoothing)
                self._seeded[int(width)] = float(seconds)
                if stored:
                    self._from_store.add(int(width))
                    self._ages[int(width)] = int((ages or {}).get(int(width), 0))
                else:
                    self._from_store.discard(int(width))
                    self._ages.pop(int(width), None)
        self._line = self._live_line = None

    @property
    def seeded(self) -> bool:
        """Some widths still hold values from an earlier process."""
        return bool(self._seeded)

    def _check_seed(self, width: int, seconds: float) -> bool:
        """Keep this live measurement aside until there are enough to judge the seeded value; True when the seeded
        widths were dropped as stale (the live measurements then start the curve anew)."""
        live = self._live.setdefault(width, [])
        live.append(seconds)
        if len(live) < self.STALE_AFTER:
            self._means[width].add(min(seconds, 3 * self._means[width].value))
            return False
        ratio = sorted(live)[len(live) // 2] / self._seeded[width]
        band = max(self.STALE_FACTOR, max(live) / min(live))  # the steps' own noise: a busy machine widens it
        del self._seeded[width], self._live[width]
        self._from_store.discard(width)
        if 1 / band <= ratio <= band:
            self._means[width].add(min(seconds, 3 * self._means[width].value))
            return False
        log.info("stored step cost of width %d disagrees with this process's (%.2fx, beyond the %.2fx its steps "
                 "vary by); measuring it again", width, ratio, band)
        # this process's calibration was timed in one moment: what was off at one width was off at all of them
        stale = {width} | {w for w in self._seeded if w not in self._from_store}
        for w in stale:
            self._means.pop(w, None)
            self._seeded.pop(w, None)
        self._live_line = self._line = None
        for w, values in [(width, live), *[(w, self._live.pop(w)) for w in stale if w in self._live]]:
            for value in values:
                self.observe(w, value)
        return True

    def measured(self) -> dict[int, float]:
        return {w: m.value for w, m in sorted(self._means.items())}

    def _untimed(self, width: int) -> bool:
        """A width read from the store that this process has not timed."""
        return width in self._seeded and width in self._from_store and width not in self._live

    def stored(self) -> dict[int, float]:
        """What is worth storing for the next process: the widths this process measured or confirmed, and the
        stored widths it never timed while fewer than ``MAX_AGE`` processes have passed them on so (``unconfirmed``
        gives their new ages)."""
        return {w: m.value for w, m in sorted(self._means.items())
                if not self._untimed(w) or self._ages.get(w, 0) + 1 < self.MAX_AGE}

    def unconfirmed(self) -> dict[int, int]:
        """The ages to store with ``stored``'s untimed widths (processes in a row that passed each on)."""
        return {w: self._ages.get(w, 0) + 1 for w in self.stored() if self._untimed(w)}

    def __bool__(self) -> bool:
        return bool(self._means)

    def __call__(self, width: int) -> float:
        if self._line is None:
            self._line = self._fit(self._means)
        cost = self._read(self._line, width)
        if self._seeded:
            if self._live_line is None:
                live = {w: m for w, m in self._means.items() if w not in self._seeded}
                self._live_line = self._fit(live) if len(live) >= 2 else ()
            if self._live_line:
                cost = min(cost, self._read(self._live_line, width))
        return cost

    @staticmethod
    def _read(line: tuple[float, float, float, float], width: int) -> float:
        base, anchor_width, anchor_seconds, slope = line
        if width <= 1:
            return base
        return max(base, anchor_seconds + slope * (width - anchor_width))

    def at(self, width: int, min_count: float = 5.0) -> float:
        """The mean measured at ``width`` once it has ``min_count`` observations (a padded batch pass is not on
        the line the narrow passes draw), else the line."""
        mean = self._means.get(width)
        return mean.value if mean is not None and mean.count >= min_count else self(width)

    def _fit(self, means: dict[int, RunningMean]) -> tuple[float, float, float, float]:
        """(one-token time, a point of the line for wider passes, its slope) of ``means``; refitted only after an
        observation, since the engine reads the curve many times per step."""
        if not means:
            raise ValueError("no step has been timed yet")
        one = means.get(1)
        wide = [(w, m.value, min(m.count, 20.0)) for w, m in means.items() if w > 1]
        if one is None:  # only wide passes timed so far: scale the narrowest one down along the prior
            w0, t0, _ = min(wide)
            base = t0 / (1 + self.prior_slope * (w0 - 1))
        else:
            base = one.value
        if len(wide) >= 2:
            # Theil-Sen: the weighted median of the slopes between pairs of widths, then of the intercepts. A width
            # measured once during a stall (several times its neighbours' cost) moves a median little, where it
            # tilted a least-squares line enough to make every draft look dear
            pairs = [((tj - ti) / (wj - wi), min(ci, cj)) for i, (wi, ti, ci) in enumerate(wide)
                     for wj, tj, cj in wide[i + 1:]]
            slope = max(0.0, _weighted_median(pairs))
            intercept = _weighted_median([(t - slope * w, c) for w, t, c in wide])
            return base, 0.0, intercept, slope
        if len(wide) == 1:
            w0, t0, _ = wide[0]
            return base, 1.0, base, (t0 - base) / (w0 - 1)
        return base, 1.0, base, base * self.prior_slope


def _weighted_median(values: list[tuple[float, float]]) -> float:
    """The median of (value, weight) pairs: the smallest value with at least half the total weight at or below."""
    ordered = sorted(values)
    half, acc = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        acc += weight
        if acc >= half:
            return value
    return ordered[-1][0]


_CURVES: "weakref.WeakKeyDictionary[object, dict[object, CostCurve]]" = weakref.WeakKeyDictionary()
COST_RECORD = "cost-curve"  # the kind of record a curve is stored as (verispec.backends.measurements)
UNCONFIRMED = "unconfirmed"  # a record's entry: the ages of the widths passed on untimed (CostCurve.MAX_AGE)
SAVE_INTERVAL_S = 10.0


def shared_cost_curve(target, trees: bool = False) -> CostCurve:
    """The one cost curve of a target model in this process (every decoder over it measures into it) for the way its
    passes run now (``target.cost_state``: a compiled program that arrives mid-process starts another curve, since
    its passes cost something else), started from the curve an earlier process stored for the same model, settings
    and machine (``target.measurement_key``). ``trees``: the curve of decoders whose wide passes are token trees
    (their own: a tree pass of w tokens can cost far more than a chain's, which may run compiled)."""
    curves = _CURVES.get(target.cost_key)
    if curves is None:
        curves = _CURVES[target.cost_key] = {}
    state = (getattr(target, "cost_state", None), trees)  # backends whose passes never change have none
    curve = curves.get(state)
    if curve is None:
        curve = curves[state] = CostCurve()
        curve.key = target.measurement_key
        if curve.key is not None and trees:
            curve.key = {**curve.key, "passes": "trees"}
        stored = measurements.load(COST_RECORD, curve.key)
        if stored:
            stored = dict(stored)
            ages = {int(w): int(a) for w, a in (stored.pop(UNCONFIRMED, None) or {}).items()}
            curve.seed({int(w): s for w, s in stored.items()}, ages=ages)
            log.info("step costs of %s from an earlier run: %s", target.name, stored)
    return curve


def save_cost_curve(curve: CostCurve, force: bool = False) -> None:
    """Store what this process measured (at most every SAVE_INTERVAL_S unless ``force``), for the next process."""
    if curve.key is None or not curve.changed or not curve:
        return
    now = time.monotonic()
    if not force and now - curve.saved_at < SAVE_INTERVAL_S:
        return
    curve.saved_at, curve.changed = now, False
    record: dict = {str(w): s for w, s in curve.stored().items()}
    ages = curve.unconfirmed()
    if ages:
        record[UNCONFIRMED] = {str(w): a for w, a in ages.items()}
    measurements.save(COST_RECORD, curve.key, record)


class Acceptance:
    """P(draft position i accepted | positions < i accepted) per position, and calibration tables from a
    drafter's confidence (ten bins over [0, 1]) to the same conditional probability: one for a draft's first
    position, one for the positions after it. A position reached only after the ones before it were accepted is
    likelier to be accepted at the same confidence (a suffix draft that matched goes on matching: 0.4 at the first
    position, 0.74-0.94 at the next three on code edits), which one table for all positions, filled mostly by first
    positions, had missed: it kept drafts whose every position said 0.8 to one token."""

    BINS = 10

    def __init__(self, prior: float = 0.6, weight: float = 2.0, smoothing: float = 0.05) -> None:
        self.prior, self.weight, self.smoothing = prior, weight, smoothing
        self.positions: list[RunningMean] = []
        self.bins = self._new_bins()  # a draft's first position
        self.later = self._new_bins()  # the positions after it
        # verdicts seen per bin of ``later``: a bin never reached says what the first position's bin says (not the
        # bin's middle), and starts there when it is: a drafter stopped at one token by a pessimistic later bin would
        # never reach that bin to correct it
        self.later_seen = [0] * self.BINS

    def _new_bins(self) -> list[RunningMean]:
        return [RunningMean((b + 0.5) / self.BINS, self.weight, self.smoothing) for b in range(self.BINS)]

    def copy(self, max_weight: float) -> "Acceptance":
        """A per-request copy that starts from this history but follows the request after a few steps."""
        out = Acceptance(self.prior, self.weight, self.smoothing)
        out.positions = [m.copy(max_weight) for m in self.positions]
        out.bins = [m.copy(max_weight) for m in self.bins]
        out.later = [m.copy(max_weight) for m in self.later]
        out.later_seen = list(self.later_seen)
        return out

    def _position(self, i: int) -> RunningMean:
        while len(self.positions) <= i:
            # an unseen position starts where the last seen one is (acceptance falls slowly with depth)
            start = self.positions[-1].value if self.positions else self.prior
            self.positions.append(RunningMean(start, self.weight, self.smoothing))
        return self.positions[i]

    def at(self, i: int) -> float:
        """Estimated acceptance of position i (0-based) without a confidence."""
        if i < len(self.positions):
            return self.positions[i].value
        return self.positions[-1].value if self.positions else self.prior

    def relax(self, toward: "Acceptance", rate: float) -> None:
        """Move each position's estimate the share ``rate`` of the way to ``toward``'s: evidence ages while no
        draft is verified (the text may have turned), so a request's estimate drifts back to the drafter's long run."""
        for i, mean in enumerate(self.positions):
            mean.value += (toward.at(i) - mean.value) * rate

    def calibrated(self, confidence: float, position: int = 0) -> float:
        """Acceptance of draft position ``position`` (0-based; those before it accepted) at ``confidence``."""
        b = _bin(confidence, self.BINS)
        return (self.later if position and self.later_seen[b] else self.bins)[b].value

    def observe(self, verified: int, accepted: int, confidence: list[float] | None = None) -> None:
        """A draft of which ``verified`` tokens were checked and the first ``accepted`` of them kept."""
        for i in range(min(verified, accepted + 1)):  # the positions that were reached
            hit = 1.0 if i < accepted else 0.0
            self._position(i).add(hit)
            if confidence is not None and i < len(confidence):
                b = _bin(confidence[i], self.BINS)
                if i and not self.later_seen[b]:
                    self.later[b].value = self.bins[b].value
                if i:
                    self.later_seen[b] += 1
                (self.later if i else self.bins)[b].add(hit)


def _bin(confidence: float, bins: int) -> int:
    return min(bins - 1, max(0, int(confidence * bins)))


@dataclass
class Decision:
    """What the controller chose for one step and what it predicted."""

    n: int  # the most draft tokens the step may verify: asked of the drafter (draft_budget), kept (verify_length)
    predicted_tokens: float  # expected committed tokens
    predicted_seconds: float  # expected step time (draft + verify)
    probe: bool = False  # verified to learn, against the rule's advice
    open: bool = False  # n is a ceiling: a drafter that stops early ends the draft where ``draft_more`` says

    @property
    def rate(self) -> float:
        return self.predicted_tokens / self.predicted_seconds if self.predicted_seconds > 0 else float("inf")


@dataclass
class RequestState:
    """Per request: its acceptance (seeded from the drafter's history) and the probing schedule."""

    acceptance: Acceptance
    speculating: bool = True
    plain_run: int = 0  # consecutive steps decided plain
    probe_interval: int = 8
    probe_pending: bool = False  # the current step is a probe
    probe_needs: float = 2.0  # tokens the probe's step must commit to pay for itself (see Controller._choose)
    drafted: bool = False  # the request's first proposal (which also reads the prompt) has been made
    behind: int = 0  # tokens a drafter that reads every token has not read: the prompt, then one per plain step


class Controller:
    """Chooses the draft length per step for one drafter over one target (see the module docstring).

    ``costs``: the target's step time by width (shared by every decoder of the model in this process);
    ``source``, where given, is asked for it again at every step (``follow_source``; ``shared_cost_curve``: the
    curve of the target's passes as they run now, which changes when a compiled program arrives, mid-request too).
    ``policy``: ``cost`` (the rule) or ``fixed`` (verify every draft token the drafter offers, up to k: for
    experiments and for comparison)."""

    def __init__(self, costs: CostCurve, policy: str = COST, margin: float = 0.03, probe_length: int = 2,
                 first_probe_interval: int = 8, max_probe_interval: int = 64, request_weight: float = 4.0,
                 cheap_draft: float = 0.02, plain_relax: float = 0.03,
                 source: Callable[[], CostCurve] | None = None, flat_cost: bool = False,
                 stops_early: bool = False) -> None:
        if policy not in K_POLICIES:
            raise InvalidRequest(f"k policy must be one of {', '.join(K_POLICIES)}, got {policy!r}")
        self._costs = costs
        self.source = source
        self.policy = policy
        self.margin = margin
        self.probe_length = probe_length
        self.first_probe_interval = first_probe_interval
        self.max_probe_interval = max_probe_interval
        self.request_weight = request_weight
        self.cheap_draft = cheap_draft
        self.plain_relax = plain_relax  # per plain step: how far the request's acceptance drifts back to the long run
        self.history = Acceptance()  # across requests, for this drafter (follows the last few dozen drafts)
        self.longrun = Acceptance(smoothing=0.002)  # the same over the last several hundred drafts
        # a pass shared with other sequences (verispec.batching): what a pass over w of this sequence's tokens
        # computes in all, and the tokens the others commit with it (both 0 extra when the pass is ours alone)
        self.width_of: Callable[[int], int] | None = None
        self.other_tokens = 0.0
        self.draft_seconds_per_token = RunningMean(0.0, 0.0, 0.1)  # across requests (per proposal: flat_cost)
        # the drafter's proposals cost about the same whatever their length (``Drafter.flat_cost``: lookups)
        self.flat_cost = flat_cost
        # the drafter drafts token by token and stops where ``draft_more`` says (``Drafter.stops_early``)
        self.stops_early = stops_early
        # what reading one committed token costs a drafter that catches up (a draft model after plain steps)
        self.catch_up_seconds_per_token = RunningMean(0.0, 0.0, 0.1)
        self.state = self.start_request()

    # ------------------------------------------------------------------ lifecycle
    @property
    def costs(self) -> CostCurve:
        return self._costs

    @costs.setter
    def costs(self, curve: CostCurve) -> None:  # a curve given by hand stays: ``source`` no longer replaces it
        self._costs, self.source = curve, None

    def follow_source(self) -> bool:
        """Take the curve ``source`` gives now; True when it is another one (a compiled program arrived: the passes
        from here on cost what it costs, and timing them into the old curve would mix two engines)."""
        if self.source is None:
            return False
        curve = self.source()
        if curve is self._costs:
            return False
        self._costs = curve
        return True

    def start_request(self, prompt_tokens: int = 0) -> RequestState:
        """A new request of ``prompt_tokens`` tokens, which a drafter that catches up (a draft model) reads with its
        first proposal."""
        self.follow_source()
        acceptance = self.history.copy(self.request_weight)
        self.state = RequestState(acceptance, probe_interval=self.first_probe_interval,
                                  behind=max(0, prompt_tokens - 1))
        return self.state

    @property
    def active(self) -> bool:
        """False while the rule has nothing to go on (fixed policy, or no step timed yet)."""
        return self.policy == COST and bool(self.costs)

    # ------------------------------------------------------------------ costs
    def share_passes(self, width_of: Callable[[int], int] | None, other_tokens: float = 0.0) -> None:
        """Decide as one sequence of a batch: a step over w of this sequence's tokens runs a pass over
        ``width_of(w)`` tokens that also commits ``other_tokens`` for the other sequences. Then drafts pay only
        if they raise the whole pass's tokens per second: under load, speculation shrinks or stops by itself.
        ``None`` = a pass of its own."""
        self.width_of, self.other_tokens = width_of, other_tokens if width_of is not None else 0.0

    def pass_cost(self, width: int) -> float:
        """Seconds of the pass that verifies ``width`` tokens of this sequence."""
        return self.costs(self.width_of(width) if self.width_of is not None else width)

    def draft_cost(self, n: int) -> float:
        """Seconds a proposal of ``n`` tokens costs: per token, or one proposal's whatever its length (flat_cost)."""
        if not n or not self.draft_seconds_per_token.count:
            return 0.0
        return self.draft_seconds_per_token.value * (1 if self.flat_cost else n)

    def catch_up_cost(self) -> float:
        """Seconds the drafter will spend reading what it has not read: the prompt before its first proposal, then
        the tokens committed by plain steps since it last ran (0 for a drafter that reports no catch-up). Paid once,
        it serves the drafting steps that follow: a decision counts it spread over ``first_probe_interval`` steps,
        the run the probing schedule gives a drafter to prove itself."""
        mean = self.catch_up_seconds_per_token
        return mean.value * self.state.behind / self.first_probe_interval if mean.count else 0.0

    def drafting_is_cheap(self, k: int, fed: int = 1) -> bool:
        return self.draft_cost(k) < self.cheap_draft * self.pass_cost(fed)

    def _decision(self, accept: list[float], fed: int, nodes: int, draft_seconds: float) -> Decision:
        return Decision(nodes, self.other_tokens + expected_tokens(accept), draft_seconds + self.pass_cost(fed + nodes))

    def _best(self, accept: list[float], fed: int, draft_cost: bool) -> tuple[Decision, Decision]:
        """(best chain of 1..len(accept) tokens, plain step); E(n) accumulated as n grows. With ``draft_cost`` a
        draft also pays for the drafter's catch-up on the plain steps since it last ran: a one-time cost of going back
        to drafting, which a probe pays (it is left out of what a probe must commit to count as paid)."""
        plain = self._decision([], fed, 0, 0.0)
        best = plain
        catch_up = self.catch_up_cost() if draft_cost else 0.0
        for n, tokens in enumerate(expected_tokens_by_length(accept)[1:], 1):
            d = Decision(n, self.other_tokens + tokens,
                         (self.draft_cost(n) + catch_up if draft_cost else 0.0) + self.pass_cost(fed + n))
            if best.n == 0 or d.rate > best.rate:
                best = d
        return best, plain

    def _estimate(self, length: int, confidence: list[float] | None) -> list[float]:
        """Acceptance of draft positions 1..length: the calibrated confidence where the drafter gave one,
        else this request's acceptance by position."""
        acc = self.state.acceptance
        given = [] if confidence is None else [acc.calibrated(c, i) for i, c in enumerate(confidence[:length])]
        return given + [acc.at(i) for i in range(len(given), length)]

    def predicted_tokens(self, length: int, confidence: list[float] | None) -> float:
        """Expected committed tokens of a step that verifies this draft (a tree: ``length`` = its depth)."""
        return expected_tokens(self._estimate(length, confidence))

    def _choose(self, best: Decision, plain: Decision, fed: int = 1, tree: bool = False, length: int = 1) -> Decision:
        """Plain or speculative, with hysteresis and the probing schedule (a tree probes with its whole budget:
        what is in question is the cost of the wide pass). A probe brings the next one closer only if it paid: it
        committed as many tokens as a step of its width and drafting cost must to match a plain step (for a chain
        probe, one accepted token where passes cost about the same; for a tree on a pass 3.6x a step, 3.6). A chain
        of up to ``length`` tokens that could not pay with every token accepted is not probed (``_could_pay``)."""
        st = self.state
        if best.n == 0:
            return plain
        gain = best.rate / plain.rate
        # the margin is on this sequence's share of the pass's tokens: in a batch its choice moves the batch's
        # rate by only that share, and each sequence must still pay its way
        margin = self.margin / (1.0 + self.other_tokens)
        st.speculating = gain > 1 - margin if st.speculating else gain > 1 + margin
        if st.speculating:
            st.plain_run = 0
            return best
        st.plain_run += 1
        st.acceptance.relax(self.longrun, self.plain_relax)
        if st.plain_run >= st.probe_interval:
            st.plain_run = 0  # looked at once an interval: a drafter that could not pay is asked again after the next
            if not (tree or self._could_pay(fed, length)):
                return plain
            st.probe_pending = True
            k = best.n if tree else min(self.probe_length, best.n)
            seconds = self.pass_cost(fed + k) + self.draft_cost(k)
            st.probe_needs = (1.0 + self.other_tokens) * seconds / plain.predicted_seconds - self.other_tokens
            return Decision(k, best.predicted_tokens, best.predicted_seconds, True)
        return plain

    def _could_pay(self, fed: int, length: int) -> bool:
        """Whether a chain of up to ``length`` drafts could beat a plain step were every token accepted, its catch-up
        counted: a probe of a drafter that cannot is skipped (a draft model that costs more than its target's wide
        passes save, as on llama.cpp's quantized kernels, whose 2-token pass costs about two 1-token passes)."""
        best, plain = self._best([1.0] * max(1, length), fed, draft_cost=True)
        return best.n > 0 and best.rate > plain.rate * (1 + self.margin)

    # ------------------------------------------------------------------ decisions
    def draft_budget(self, k_max: int, fed: int = 1, tree_depth: int | None = None) -> Decision:
        """Draft tokens (tree nodes with ``tree_depth``) to ask for; 0 = a plain step with no drafting work."""
        self.state.probe_pending = False
        if k_max <= 0 or not self.active:
            return Decision(max(k_max, 0), 1.0, 0.0)
        acc = self.state.acceptance
        if tree_depth is not None:
            # a tree spends its whole node budget in one pass; its accepted path is measured by depth
            tree = self._decision([acc.at(i) for i in range(min(tree_depth, k_max))], fed, k_max,
                                  self.draft_cost(k_max))
            return self._choose(tree, self._decision([], fed, 0, 0.0), fed, tree=True)
        if self.drafting_is_cheap(k_max, fed):
            # drafting costs nothing next to a pass: draft the most, verify_length decides on the draft itself
            best, _ = self._best([acc.at(i) for i in range(k_max)], fed, draft_cost=False)
            return Decision(k_max, best.predicted_tokens, best.predicted_seconds)
        best, plain = self._best([acc.at(i) for i in range(k_max)], fed, draft_cost=True)
        decision = self._choose(best, plain, fed, length=k_max)
        if decision.n == 0:
            self.state.behind += 1  # the drafter does not run this step: it will read this step's token later
        elif self.flat_cost and not decision.probe:
            # a longer draft costs no more: ask for the most, and verify_length keeps what the draft's own
            # confidences say pays (the acceptance by position alone, its first position lowered by every weak
            # match, had chosen one token)
            decision = Decision(k_max, decision.predicted_tokens, decision.predicted_seconds)
        elif self.stops_early and not decision.probe:
            # the drafter stops where its tokens' confidences say another would not pay (draft_more): the
            # acceptance by position alone never learns of a position it never drafts (a draft model accepted 98%
            # at its first position was kept at one token by one early miss at its second)
            decision = Decision(k_max, decision.predicted_tokens, decision.predicted_seconds, open=True)
        return decision

    def draft_more(self, confidence: list[float], k_max: int, fed: int = 1) -> bool:
        """While a drafter that stops early drafts (``Decision.open``): whether another token is worth drafting after
        those with these confidences. The positions after them are taken at the last one's calibrated confidence (a
        draft model sure of one token is often sure of the next; what that predicts is learned per confidence at
        the positions after a draft's first); drafting goes on while some longer draft, its drafting and its wider
        pass counted, would commit more tokens a second than the draft so far. It reads the confidences only, never
        the drawn tokens, so it is a stopping rule (lossless, as verify_length's)."""
        i = len(confidence)
        if i == 0:
            return True
        if i >= k_max or not self.active:
            return i < k_max
        known = self._estimate(i, confidence)
        ahead = self.state.acceptance.calibrated(confidence[-1], i)
        rate = lambda accept: (self.other_tokens + expected_tokens(accept)) / (  # noqa: E731
            self.draft_cost(len(accept)) + self.pass_cost(fed + len(accept)))
        now = rate(known)
        return any(rate(known + [ahead] * m) > now for m in range(1, k_max - i + 1))

    def verify_length(self, length: int, confidence: list[float] | None, deterministic: bool,
                      fed: int = 1) -> Decision:
        """How many tokens of a chain draft of ``length`` to verify (the drafting cost is spent)."""
        if length == 0 or not self.active:
            return Decision(length, 1.0, 0.0)
        st = self.state
        if st.probe_pending:  # draft_budget asked for this draft as a probe
            return Decision(min(length, self.probe_length), 1.0, self.pass_cost(fed + min(length, self.probe_length)),
                            True)
        prior = self._estimate(length, None)
        estimate = prior if confidence is None else self._estimate(length, confidence)
        if deterministic or confidence is None:
            n = length
        else:
            # a stopping rule: whether position i is verified depends on the confidences of 1..i only
            n = length
            for i in range(1, length + 1):
                if self._best(estimate[:i] + prior[i:], fed, draft_cost=False)[0].n < i:
                    n = i - 1
                    break
        best, plain = self._best(estimate[:n], fed, draft_cost=False)
        if self.drafting_is_cheap(length, fed):
            return self._choose(best, plain, fed, length=length)  # the step's one plain-or-speculate decision
        # the budget decided to speculate; with the draft paid for, verify what pays
        return best if best.n and best.rate > plain.rate else plain

    # ------------------------------------------------------------------ feedback
    def observe_draft(self, proposed: int, seconds: float, catch_up: int = 0, catch_up_seconds: float = 0.0) -> None:
        """A proposal of ``proposed`` tokens took ``seconds``, of which ``catch_up_seconds`` went to reading
        ``catch_up`` committed tokens first (``Draft.catch_up``)."""
        st = self.state
        if catch_up > 0:
            self.catch_up_seconds_per_token.add(catch_up_seconds / catch_up)
        # a request's first proposal also reads the whole prompt (an EAGLE head, a draft model's prefill): a
        # one-time cost, not what each further draft token costs
        if proposed and (st.drafted or catch_up):
            self.draft_seconds_per_token.add(max(0.0, seconds - catch_up_seconds) / (1 if self.flat_cost else proposed))
        st.drafted = st.drafted or bool(proposed)
        st.behind = 0

    def observe_step(self, width: int, seconds: float) -> None:
        self.costs.observe(width, seconds)

    def observe_verdict(self, verified: int, accepted: int, confidence: list[float] | None = None) -> None:
        """``verified`` draft positions were checked (the depth, for a tree) and ``accepted`` kept."""
        st = self.state
        if verified:
            st.acceptance.observe(verified, accepted, confidence)
            self.history.observe(verified, accepted, confidence)
            self.longrun.observe(verified, accepted)
            if st.probe_pending:  # a probe that paid for itself brings the next one close; else they back off
                st.probe_interval = (self.first_probe_interval if accepted + 1 >= st.probe_needs
                                     else min(2 * st.probe_interval, self.max_probe_interval))
        st.probe_pending = False
