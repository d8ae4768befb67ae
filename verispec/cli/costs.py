"""``verispec costs``: what a pass of w tokens costs on each engine, as c(w) / c(1), beside the memory floor.

Speculation pays only where a pass over k + 1 tokens costs little more than a one-token pass; this prints that curve
for every installed engine that runs the model's own weights (or those named), measured here with the same context,
and the floor a one-token pass cannot beat: the bytes of the model's file over the read bandwidth measured with the
same threads. With ``--arithmetic-floor``, the blocks engine's row also gets the products of each pass timed with
their weights in cache (its backend's ``arithmetic_floor``): where they come close to the pass, the kernel's arithmetic
binds, not memory.
"""

from __future__ import annotations

import json
import time

from ..errors import InvalidRequest

DEFAULT_WIDTHS = "1,2,3,4,6,8,12,16"


def add_costs_parser(sub) -> None:
    p = sub.add_parser(
        "costs", help="pass cost by width c(w) on each engine, beside the memory floor",
        description="Time one pass over w new tokens after --context cached ones on each engine (widths interleaved "
                    "within each round, the first round dropped; median of --repeats), and print ms and c(w)/c(1) "
                    "side by side with the memory floor: the model file's bytes over the read bandwidth measured "
                    "here. Ends with a one-line JSON summary.")
    p.add_argument("--target", default=None, help="model reference (default: the built-in default model)")
    p.add_argument("--backends", default=None,
                   help="comma-separated engines (default: every installed one that runs the file's own weights)")
    p.add_argument("--widths", default=DEFAULT_WIDTHS, help=f"comma-separated pass widths (default: {DEFAULT_WIDTHS})")
    p.add_argument("--context", type=int, default=256, help="cached tokens before each pass (default: 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (default: 5)")
    p.add_argument("--threads", type=int, default=None, help="threads of every engine (default: this process's cores)")
    p.add_argument("--arithmetic-floor", action="store_true",
                   help="blocks engine: also time each pass's products with their weights in cache (what they cost "
                        "were memory free; by block type; ~25 s more for five widths): the arithmetic floor beside "
                        "the memory floor")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw the curves to this PNG file: ms a pass beside the memory floor, and c(w) / c(1)")
    p.set_defaults(func=cmd_costs)


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise InvalidRequest(f"--widths takes comma-separated integers, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise InvalidRequest(f"--widths must be positive integers, got {text!r}")
    return tuple(sorted(set(widths)))


def cmd_costs(args) -> int:
    from pathlib import Path

    from ..backends import DEFAULT_MODEL, backend_specs, get_backend, load_model
    from ..backends.references import gguf_file
    from ..backends.timing import default_threads, read_bandwidth, time_passes

    target = args.target or DEFAULT_MODEL
    widths = _widths(args.widths)
    if 1 not in widths:
        widths = (1, *widths)
    if args.backends:
        names = [b.strip() for b in args.backends.split(",") if b.strip()]
        for name in names:
            get_backend(name)  # an unknown name is refused with the list
    else:
        names = [s.name for s in backend_specs() if s.installed() and s.runs_own_weights(target)]
    if not names:
        raise InvalidRequest(f"no installed engine runs {target!r}; name one with --backends")
    floors = [s.name for s in backend_specs() if s.arithmetic_floor]
    if args.arithmetic_floor and not set(floors) & set(names):
        raise InvalidRequest(f"--arithmetic-floor times the products of {' or '.join(floors) or 'no backend here'}; "
                             f"add {floors[0] if floors else 'one that has them'} to --backends "
                             f"(timing {', '.join(names)})")
    if args.plot and not Path(args.plot).parent.is_dir():
        raise InvalidRequest(f"--plot {args.plot}: no folder {Path(args.plot).parent}; create it or name another")
    threads = args.threads or default_threads()
    try:
        size = Path(gguf_file(target)).stat().st_size
    except Exception:  # a folder or a hub id: no file whose bytes a pass reads
        size = None
    bandwidth = read_bandwidth(threads)
    floor = size / bandwidth * 1e3 if size else None
    results = {}
    for name in names:
        options = {"threads": threads} if get_backend(name).takes("threads") else {}
        started = time.perf_counter()
        model = load_model(target, backend=name, **options)
        loaded = time.perf_counter() - started
        results[name] = {"load_s": round(loaded, 1),
                         "ms": {w: round(v, 2) for w, v in time_passes(model, args.context, widths, args.repeats).items()},
                         "kernel": getattr(model, "kernel", "")}
        floor_of = get_backend(name).arithmetic_floor
        if args.arithmetic_floor and floor_of:
            results[name]["products_in_cache_ms"] = {
                w: {kind: round(ms, 2) for kind, ms in parts.items()}
                for w, parts in floor_of(model, widths, args.context).items()}
        del model
    from ..backends.torch_cpu.cpu import cpu_info

    info = cpu_info()
    isa = next((f for f in ("avx512_vnni", "avx512f", "avx2") if f in info["flags"]), "no AVX2")
    cpu = f"{info['model']} ({isa}, family {_cpu_family()})"
    print(f"{target}: one pass of w tokens after {args.context} cached, median of {args.repeats} rounds, "
          f"{threads} threads, {cpu}")
    if floor:
        print(f"memory floor: {size / 1e9:.3f} GB at {bandwidth / 1e9:.1f} GB/s read = {floor:.1f} ms a pass")
    head = "| engine | " + " | ".join(f"w={w}" for w in widths) + " |"
    print(head)
    print("|---|" + "---:|" * len(widths))
    for name, r in results.items():
        base = r["ms"][1]
        cells = [f"{r['ms'][w]:.1f} ms ({r['ms'][w] / base:.2f})" for w in widths]
        print(f"| {name} | " + " | ".join(cells) + " |")
        cached = r.get("products_in_cache_ms")
        if cached:
            print(f"| {name}: products, weights in cache | "
                  + " | ".join(f"{cached[w]['all']:.1f} ms ({cached[w]['all'] / r['ms'][w]:.0%})" for w in widths) + " |")
            kinds = [k for k in cached[widths[0]] if k != "all"]
            for kind in kinds:
                print(f"| ... of which {kind} | " + " | ".join(f"{cached[w].get(kind, 0.0):.1f} ms" for w in widths)
                      + " |")
    summary = {"target": target, "threads": threads, "context": args.context, "cpu": cpu,
               "floor_ms": round(floor, 2) if floor else None, "bandwidth_gbs": round(bandwidth / 1e9, 2),
               "engines": results}
    if args.plot:
        from ..bench.plots import pass_costs

        # drawn from the summary as its JSON reads (widths as string keys), so a saved one draws the same
        print(f"chart: {pass_costs(json.loads(json.dumps(summary)), Path(args.plot))}")
    print(json.dumps(summary))
    return 0


def _cpu_family() -> str:
    """The CPU family and model numbers (AMD's family 25 is Zen 3/4, 26 Zen 5): the model name alone ("AMD EPYC")
    does not say which."""
    try:
        block = open("/proc/cpuinfo").read().split("\n\n")[0]
        fields = {k.strip(): v for k, v in (line.split(":", 1) for line in block.splitlines() if ":" in line)}
        return f"{fields['cpu family'].strip()}, model {fields['model'].strip()}"
    except (OSError, KeyError, ValueError):
        return "unknown"
