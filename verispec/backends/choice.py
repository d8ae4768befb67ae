"""``--backend auto``: the fastest installed engine on this machine that runs the model's own weights.

The candidates keep the weights as the model ships them: on a GGUF source (a built-in name or a .gguf file)
OpenVINO holding the file's own blocks (``--weights as-is``), llama.cpp on the file, and transformers on its values in
float32; on a transformers folder OpenVINO fp32 and transformers. Formats that re-quantize (int8, int4) are never
candidates: they are another model (``openvino.export.CHANGES_MODEL``).

Choosing prepares nothing but the engine chosen. Where this model was timed on this CPU (``verispec models --time``:
each installed candidate prepared, loaded and its pass costs timed, ``timing.time_widths``, scored by the tokens a
second they promise for speculation, ``timing.auto_score``, and stored with the other measurements) the timing
decides. Otherwise each candidate's declared cost of the file (``BackendSpec.cost`` of its bytes per tensor type, read
from the GGUF header) is compared, in ms when the nearest model timed here scales it; the cheapest wins, a tie within
``TIE`` goes to the preferred engine.

Options only one backend takes decide it without timing: ``dtype`` other than float32 or ``compiled="on"``
(transformers), a llama.cpp weight format such as ``q8_0`` (llamacpp), an OpenVINO one such as ``int4`` (openvino):
whatever the registered backends' declared options accept (``verispec.backends.registry``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequest
from . import measurements, timing
from .references import gguf_type_bytes
from .registry import AUTO, backend_names, backend_specs, get_backend

log = logging.getLogger(__name__)

ENV = "VERISPEC_BACKEND"  # the command line's and server's default --backend (auto unless set)
RECORD = "backend-auto"  # the kind of record the choice is stored as (verispec.backends.measurements)


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    weights: str
    reason: str
    timings_ms: dict | None = None  # backend -> its measured pass costs, when timed

    def summary(self) -> str:
        return f"--backend auto chose {self.backend} ({self.weights} weights): {self.reason}"


def default_backend() -> str:
    """The command line's and server's default ``--backend``: $VERISPEC_BACKEND (auto or a registered backend),
    else auto."""
    import os

    value = os.environ.get(ENV, "").strip().lower() or AUTO
    if value not in (AUTO, *backend_names()):
        raise InvalidRequest(f"${ENV} is {value!r}; set it to one of {AUTO}, {', '.join(backend_names())}")
    return value


def installed(backend: str) -> bool:
    return get_backend(backend).installed()


def candidates(ref: str) -> list[str]:
    """The installed backends that run ``ref``'s own weights, the preferred first (a tie goes to it)."""
    found = [spec for spec in backend_specs()
             if spec.auto and installed(spec.name) and spec.runs_own_weights(ref)]
    return [spec.name for spec in sorted(found, key=lambda spec: -spec.preference)]


def implied(options: dict) -> str | None:
    """The backend that options only it takes name, or None (every backend, or several, take them)."""
    taking = []
    for spec in backend_specs():
        try:
            spec.keywords(options)
        except InvalidRequest:
            continue
        taking.append(spec.name)
    return taking[0] if len(taking) == 1 else None


def choose(ref: str, load, options: dict | None = None, *, measure: bool = False, **keywords) -> BackendChoice:
    """What ``--backend auto`` runs ``ref`` on, given the load ``options`` asked for (see ``verispec.load_model``).

    Nothing is prepared to decide: a choice timed earlier on this CPU is read back, else each candidate's pass is
    estimated (``estimates``) and only the engine chosen is prepared by the caller. ``measure`` times every
    candidate now (each one prepared and loaded: minutes on a new model) and stores the timings, which every later
    choice for this model, CPU and software reads (``verispec models --time``). ``load`` is ``verispec.load_model``
    (passed in: nothing under ``backends`` imports the package's entry point)."""
    options = {**(options or {}), **keywords}
    named = implied(options)
    if named is not None:
        return BackendChoice(named, str(options.get("weights") or "as-is"),
                             "the only backend that takes the options given")
    found = candidates(ref)
    if not found:
        raise InvalidRequest(f"no installed backend runs {ref!r}")
    if len(found) == 1:
        missing = [name for name in sorted(backend_names(), key=lambda n: -get_backend(n).preference)
                   if not installed(name)]
        return BackendChoice(found[0], "as-is", "the only installed engine for this model" + (
            f" (not installed: {', '.join(missing)})" if missing else ""))
    threads = options.get("threads") or timing.default_threads()
    key = _key(ref, found, threads)
    known = None if measure else measurements.load(RECORD, key)
    if known is None and measure:
        known = _time_all(ref, load, found, threads)
        measurements.save(RECORD, key, known)
    if known is None:
        return _estimated(ref, found, threads)
    timings = known["timings_ms"]
    score = {b: timing.auto_score(t) for b, t in timings.items()}
    reason = "timed on this CPU, estimated ms a token for speculation: " + ", ".join(
        f"{b} {score[b]:.1f}" for b in sorted(score, key=score.get))
    return BackendChoice(known["choice"], "as-is", reason, timings)


def _key(ref: str, found: list[str], threads: int) -> dict:
    return {**measurements.machine(), "model": ref, "source": _fingerprint(ref), "candidates": found,
            "threads": threads, "v": 1}


def _time_all(ref: str, load, found: list[str], threads: int) -> dict:
    from tqdm.auto import tqdm

    log.warning("--backend auto: timing %s on this CPU for %s (each prepared and loaded once) ...",
                ", ".join(found), ref)
    from .steps import step

    size = sum((gguf_type_bytes(ref) or {}).values()) or None
    timings = {}
    for backend in tqdm(found, desc="--backend auto: timing each installed engine", unit="engine", leave=False,
                        disable=None):
        with step(f"preparing and timing {backend}", f"time-{backend}", size):
            model = load(ref, backend=backend, threads=threads)
            timings[backend] = timing.time_widths(model)
            del model
    value = {"timings_ms": timings, "choice": min(found, key=lambda b: timing.auto_score(timings[b]))}
    declared = estimates(ref, found)
    if declared is not None:  # what the estimate said, so that other models' estimates can be scaled by these timings
        value["estimates"] = declared
    return value


def estimates(ref: str, found: list[str]) -> dict[str, float] | None:
    """Each candidate's declared relative cost of a pass on ``ref`` (``BackendSpec.cost`` of the bytes its GGUF file
    holds per tensor type), or None: not a GGUF source, or a candidate declares none."""
    mix = gguf_type_bytes(ref)
    if mix is None:
        return None
    costs = {name: get_backend(name).cost for name in found}
    if any(cost is None for cost in costs.values()):
        return None
    return {name: float(cost(mix)) for name, cost in costs.items()}


def _estimated(ref: str, found: list[str], threads: int) -> BackendChoice:
    """The choice without timing: the declared costs, scaled per engine by the timings of the most similar model
    (the nearest in estimated cost) timed on this CPU with the same candidates and threads, when there is one; a
    tie within ``TIE`` goes to the preferred engine (the candidates' order)."""
    hint = f"not timed; `verispec models --time {ref}` times every engine once and later starts use that"
    declared = estimates(ref, found)
    if declared is None:
        return BackendChoice(found[0], "as-is", f"the preferred engine for this kind of model ({hint})")
    scaled, similar = _calibrated(declared, found, threads)
    best = min(scaled.values())
    choice = next(name for name in found if scaled[name] <= best * (1 + TIE))
    if similar is None:
        basis = "each engine's declared cost of this file's tensor types, relative: " + ", ".join(
            f"{name} {scaled[name] / best:.2f}" for name in sorted(scaled, key=scaled.get))
    else:
        basis = f"scaled from {similar}'s timings on this CPU, estimated ms a token: " + ", ".join(
            f"{name} {scaled[name]:.1f}" for name in sorted(scaled, key=scaled.get))
    return BackendChoice(choice, "as-is", f"{basis} ({hint})")


TIE = 0.10  # estimates closer than this are a tie: the preferred engine takes it


def _calibrated(declared: dict[str, float], found: list[str], threads: int) -> tuple[dict[str, float], str | None]:
    """``declared`` in estimated ms a token, by the stored timing of the nearest model with the same candidates on
    this machine; unchanged (and None) when none is stored."""
    import math

    here = measurements.machine()
    nearest, distance = None, math.inf
    for record in measurements.records():
        key = record.get("key") or {}
        if record.get("kind") != RECORD or key.get("candidates") != found or key.get("threads") != threads:
            continue
        if any(key.get(field) != value for field, value in here.items()):
            continue
        value = measurements.load(RECORD, key) or {}
        theirs = value.get("estimates") or {}
        if not all(theirs.get(name) for name in found):
            continue
        d = abs(math.log(sum(theirs.values()) / sum(declared.values())))
        if d < distance:
            nearest, distance = (key.get("model"), value, theirs), d
    if nearest is None:
        return declared, None
    model, value, theirs = nearest
    return {name: declared[name] * timing.auto_score(value["timings_ms"][name]) / theirs[name]
            for name in found}, model


def _fingerprint(ref: str) -> str:
    from .references import BUILTINS

    if ref in BUILTINS:
        return BUILTINS[ref].sha256
    path = Path(ref).expanduser()
    return measurements.file_fingerprint(path) if path.exists() else ref
