"""``--backend auto``: the fastest installed engine on this machine that runs the model's own weights.

The candidates keep the weights as the model ships them: on a GGUF source (a built-in name or a .gguf file)
OpenVINO holding the file's own blocks (``--weights as-is``), llama.cpp on the file, and transformers on its values in
float32; on a transformers folder OpenVINO fp32 and transformers. Formats that re-quantize (int8, int4) are never
candidates: they are another model (``openvino.export.CHANGES_MODEL``). Each installed candidate's pass costs are
timed once per model, CPU and software (``timing.time_widths``) and the one whose costs promise the most tokens per
second for speculation (``timing.auto_score``) is stored with the other measurements (``verispec models`` lists it);
later runs read the stored choice.

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


def choose(ref: str, load, options: dict | None = None, **keywords) -> BackendChoice:
    """What ``--backend auto`` runs ``ref`` on (timing the installed candidates once, see the module), given the
    load ``options`` asked for (see ``verispec.load_model``); ``load`` is ``verispec.load_model`` (passed in: nothing
    under ``backends`` imports the package's entry point)."""
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
    from .llamacpp import default_threads

    threads = options.get("threads") or default_threads()
    key = {**measurements.machine(), "model": ref, "source": _fingerprint(ref), "candidates": found,
           "threads": threads, "v": 1}
    known = measurements.load(RECORD, key)
    if known is None:
        from tqdm.auto import tqdm

        log.warning("--backend auto: timing %s once on this CPU for %s ...", ", ".join(found), ref)
        timings = {}
        for backend in tqdm(found, desc="--backend auto: timing each installed engine once", unit="engine",
                            leave=False, disable=None):
            model = load(ref, backend=backend, threads=threads)
            timings[backend] = timing.time_widths(model)
            del model
        known = {"timings_ms": timings, "choice": min(found, key=lambda b: timing.auto_score(timings[b]))}
        measurements.save(RECORD, key, known)
    timings = known["timings_ms"]
    score = {b: timing.auto_score(t) for b, t in timings.items()}
    reason = "estimated ms a token for speculation here: " + ", ".join(
        f"{b} {score[b]:.1f}" for b in sorted(score, key=score.get))
    return BackendChoice(known["choice"], "as-is", reason, timings)


def _fingerprint(ref: str) -> str:
    from .references import BUILTINS

    if ref in BUILTINS:
        return BUILTINS[ref].sha256
    path = Path(ref).expanduser()
    return measurements.file_fingerprint(path) if path.exists() else ref
