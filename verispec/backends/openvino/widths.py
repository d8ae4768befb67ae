"""Which pass widths the OpenVINO backend runs on graphs of static shapes, and how ``auto`` (the default) chooses.

A one-sequence pass of up to the widest static width is padded to the next static width and runs on a graph compiled
for exactly that shape (``paged.static_shapes``), cheaper than the graph of dynamic shapes; each static graph costs
~1.3 s to compile and its own copy of the weights. ``auto`` runs ``STATIC_WIDTHS`` and adds ``AUTO_STATIC_EXTRA``
where passes of the widths they cover measure cheaper on this CPU (docs/openvino.md, "Static widths chosen by
measurement").
"""

from __future__ import annotations

import logging
import statistics
import time

from ...errors import InvalidRequest

log = logging.getLogger(__name__)

# one-sequence passes of up to 6 tokens (plain steps, chains of up to 5 drafts) run on graphs of static shapes
STATIC_WIDTHS = (1, 2, 4, 6)
# ``static_widths="auto"`` (the default): those, and these too where passes of 7-10 tokens measured cheaper on them
AUTO_STATIC_EXTRA = (8, 10)
AUTO_STATIC_GAIN = 0.9  # kept when the extra graphs' passes cost at most this share of the dynamic graph's
AUTO_STATIC_RECORD = "openvino-static-widths"  # the kind of record the choice is stored as (backends.measurements)
AUTO_STATIC_ROUNDS = 7  # timed rounds (after one to warm up), both layouts interleaved in each


def parse_static_widths(text: str, sep: str = ",") -> tuple[int, ...] | str:
    """``static_widths`` from text: widths joined by ``sep`` ("2,4,6,8,10"), "none" (every pass on the dynamic
    graph) or "auto" (chosen by measurement on this CPU, ``choose_static_widths``); the backend checks the widths
    themselves when it loads."""
    if text.strip() == "none":
        return ()
    if text.strip() == "auto":
        return "auto"
    try:
        return tuple(int(w) for w in text.split(sep))
    except ValueError:
        raise InvalidRequest(f"static widths are whole numbers joined by {sep!r} (2{sep}4{sep}6), none or auto, "
                             f"got {text!r}") from None


def static_widths_option(text: str | None, backend: str) -> dict:
    """``load_model``'s keyword for the ``--static-widths`` option of generate, audit and serve: none when unset;
    refused on other backends."""
    if text is None:
        return {}
    if backend != "openvino":
        raise InvalidRequest(f"--static-widths applies to --backend openvino only (this is {backend})")
    return {"static_widths": parse_static_widths(text)}


def choose_static_widths(model) -> tuple[tuple[int, ...], dict | None]:
    """``static_widths="auto"`` (the default): ``STATIC_WIDTHS``, plus ``AUTO_STATIC_EXTRA`` where passes of the
    widths they cover cost at most ``AUTO_STATIC_GAIN`` of the dynamic graph's on this CPU. Why measure: past the
    widest static graph a pass runs on the dynamic one, which costs more than a static pass on some CPUs and about
    the same on others (docs/openvino.md has the figures per CPU), while each graph costs a second or so to compile
    and its own copy of the weights. Stored per model, format, CPU, threads and versions
    (``verispec.backends.measurements``), so a machine times it once (a few seconds); left out, unmeasured,
    where the extra graphs would not fit in a quarter of the free memory."""
    from openvino import get_version

    from .. import measurements

    base = model.static_widths
    extra = tuple(w for w in AUTO_STATIC_EXTRA if w > max(base, default=0) and w >= model.min_width)
    extended = base + extra
    if model.pool is None or not extra:
        return base, None
    if model._graphs_that_fit() < len(extended):
        log.info("static widths auto: keeping %s (the graphs for %s would not fit in a quarter of the free memory)",
                 "/".join(map(str, base)), "/".join(map(str, extra)))
        return base, None
    names = ["/".join(map(str, base)), "/".join(map(str, extended))]
    key = {**measurements.machine(), "model": model.folder.name, "weights": model.weights, "threads": model.threads,
           "kv": model.kv_precision, "min_width": model.min_width, "openvino": get_version(), "candidates": names,
           "v": 1}
    known = measurements.load(AUTO_STATIC_RECORD, key)
    if known is None:
        log.warning("--static-widths auto: timing passes of %d-%d tokens on static graphs against the dynamic one "
                    "(once on this CPU, a few seconds) ...", max(base, default=0) + 1, extended[-1])
        timings = time_static_widths(model, base, extended)
        gain = sum(timings["static"].values()) / sum(timings["dynamic"].values())
        known = {"timings_ms": timings, "static_over_dynamic": round(gain, 3),
                 "choice": names[1] if gain <= AUTO_STATIC_GAIN else names[0]}
        measurements.save(AUTO_STATIC_RECORD, key, known)
    choice = tuple(int(w) for w in known["choice"].split("/")) if known["choice"] else ()
    for width in extra:
        if width not in choice:  # compiled to be timed, not kept: its copy of the weights goes
            model._bound.pop(((), width), None)
            model._paged_requests.pop(((), width), None)
    log.info("static widths auto -> %s (passes on static graphs %.2fx the dynamic graph's)", known["choice"],
             known["static_over_dynamic"])
    return choice, known["timings_ms"]


def time_static_widths(model, base: tuple[int, ...], extended: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Median ms of passes of each width ``extended`` covers past ``base`` after ``timing.AUTO_CONTEXT`` cached
    positions (fewer where the context is shorter), on the dynamic graph (``base``) and on the static ones
    (``extended``), interleaved per round."""
    from ..timing import AUTO_CONTEXT

    widths = range(max(base, default=0) + 1, extended[-1] + 1)
    context = min(AUTO_CONTEXT, (model.context_length or AUTO_CONTEXT << 1) - extended[-1])
    # the graphs the extra widths run on (the base ones are not timed), compiled two at a time
    model._paged_requests_for([((), w) for w in extended[len(base):]])
    kv = model.new_kv()
    vocab = model.vocab_size
    times: dict[str, dict[int, list[float]]] = {name: {w: [] for w in widths} for name in ("dynamic", "static")}
    try:
        model.static_widths = base
        model.forward(kv, [(7 * i) % vocab for i in range(context)], last_only=True)
        for r in range(AUTO_STATIC_ROUNDS + 1):
            for name, layout in (("dynamic", base), ("static", extended))[:: 1 if r % 2 else -1]:
                model.static_widths = layout
                for w in widths:
                    t0 = time.perf_counter()
                    model.forward(kv, [(11 * i + r) % vocab for i in range(w)])
                    kv.truncate(context)
                    if r:
                        times[name][w].append(1000 * (time.perf_counter() - t0))
    finally:
        model.static_widths = base
        kv.close()
    return {name: {str(w): round(statistics.median(v), 3) for w, v in by_width.items()}
            for name, by_width in times.items()}
