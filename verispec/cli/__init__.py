"""Command line: ``verispec generate | audit | bench | analyze | bench-serve | serve | train-eagle | train-medusa | compile |
models``.
Argument parsing and printing live in this package, never in the library."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ..version import __version__
from .options import build_decoder, model_options, sampling_options
from .bench import add_analyze_parser, add_parsers as add_bench_parsers
from .costs import add_costs_parser
from .bench_serve import add_bench_serve_parser
from .serve import add_serve_parser
from .train import add_train_parser
from ..errors import InvalidRequest, ModelNotFound, VerispecError
from ..backends import BUILTINS, DEFAULT_MODEL

# Raw repetitive text: the n-gram drafter proposes at every tested position and the target's next-token
# distribution is spread out, so a lossy acceptance rule shows up within ~100 samples.
DEFAULT_AUDIT_PROMPT = "one two three four five one two three four five one two"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verispec",
        description="Lossless speculative decoding for Hugging Face causal LMs.",
    )
    parser.add_argument("--version", action="version", version=f"verispec {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (model resolution, timings)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text, streaming it, with speculative decoding",
                         description="Generate a continuation of PROMPT and stream it to stdout; a one-line "
                                     "stats summary follows on stderr.")
    gen.add_argument("prompt", metavar="PROMPT", help="the user message (chat template applied), or '-' to read stdin")
    model_options(gen)
    sampling_options(gen, temperature=0.0)
    g = gen.add_argument_group("output")
    g.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    g.add_argument("--seed", type=int, default=None, help="random seed; the same seed gives the same output")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop when TEXT appears (repeatable)")
    g.add_argument("--raw", action="store_true", help="continue PROMPT as raw text, without the chat template")
    g.add_argument("--json", action="store_true",
                   help='print one JSON object {"text", "token_ids", "stats", ...} instead of streaming')
    gen.set_defaults(func=cmd_generate)

    aud = sub.add_parser("audit", help="check statistically that speculative sampling is lossless",
                         description="Sample continuations with speculation and test, per position, that the "
                                     "tokens follow the target's exact distribution (chi-square goodness of fit, "
                                     "rare tokens pooled, Bonferroni over positions). Exit code 0 = PASS, 1 = FAIL.")
    aud.add_argument("--prompt", default=DEFAULT_AUDIT_PROMPT,
                     help=f"text to continue, raw unless --chat (default: {DEFAULT_AUDIT_PROMPT!r}, repetitive so "
                          "that drafts are proposed at every tested position)")
    aud.add_argument("--chat", action="store_true", help="wrap PROMPT in the chat template as a user message")
    model_options(aud)
    sampling_options(aud, temperature=1.0)
    aud.add_argument("--samples", type=int, default=300, help="continuations to draw (default: 300)")
    aud.add_argument("--positions", type=int, default=3, help="token positions tested per continuation (default: 3)")
    aud.add_argument("--alpha", type=float, default=0.01, help="family-wise significance level (default: 0.01)")
    aud.add_argument("--seed", type=int, default=0, help="first seed; sample i uses seed+i (default: 0)")
    aud.add_argument("--json", action="store_true", help="print the report as one JSON object")
    aud.set_defaults(func=cmd_audit)

    add_bench_parsers(sub)
    add_analyze_parser(sub)
    add_bench_serve_parser(sub)
    add_costs_parser(sub)
    add_serve_parser(sub)
    add_train_parser(sub)

    com = sub.add_parser("compile", help="compile a model's decoding passes ahead of time into the compile cache",
                         description="Compile the one-token decoding step of a transformers model (float32, CPU) "
                                     "and its verify passes of 2-12 tokens (one program, built where memory allows; "
                                     "VERISPEC_COMPILED_VERIFY=1/0 always/never), and the draft step of the EAGLE head "
                                     "shipped for it (float32 heads), with AOTInductor and store them in "
                                     "the compile cache, keyed by the weights, CPU and software; later processes "
                                     "load them in seconds (--compile auto, the default, uses them). Prints where "
                                     "they are and what they cost. Needs a C++ compiler.")
    com.add_argument("--target", default=DEFAULT_MODEL, metavar="REF",
                     help=f"model: built-in name, local directory, .gguf file or hub id (default: {DEFAULT_MODEL})")
    com.add_argument("--threads", type=int, help="torch threads while compiling (default: torch's choice)")
    com.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    com.set_defaults(func=cmd_compile)

    mod = sub.add_parser("models", help="list built-in models, the caches and the compiled steps stored")
    mod.add_argument("--time", metavar="REF", help="prepare and time every installed engine on this model (a built-in "
                     "name, a .gguf file or a folder) and store the timings: --backend auto then chooses by them "
                     "instead of its estimate")
    mod.add_argument("--threads", type=int, help="threads to time the engines with (default: the cores this process "
                     "may use, what every engine runs with by default)")
    mod.set_defaults(func=cmd_models)

    cache = sub.add_parser("cache", help="manage the cache (compiled programs)")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    prune = cache_sub.add_parser("prune", help="remove the least recently used compiled programs down to a size",
                                 description="Remove compiled programs (verispec compile, --compile auto), least "
                                             "recently used first, until the store is under --max-gb. Each build "
                                             "does this with $VERISPEC_COMPILED_CACHE_GB (default 8).")
    prune.add_argument("--max-gb", type=float, default=None, metavar="GB",
                       help="size to prune to (default: $VERISPEC_COMPILED_CACHE_GB, else 8; 0 removes all)")
    prune.set_defaults(func=cmd_cache_prune)
    return parser


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    decoder = build_decoder(args)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop=args.stop, raw=args.raw)
    if args.json:
        result = decoder.generate(prompt, **options)
        print(json.dumps(result.to_dict()))
        return 0
    stream = decoder.stream(prompt, **options)
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[verispec] {stream.result.stats.summary()}", file=sys.stderr)
    return 0


def cmd_audit(args) -> int:
    from tqdm import tqdm

    from ..audit import run_audit

    decoder = build_decoder(args)
    prompt_ids = decoder.encode(args.prompt, raw=not args.chat)
    with tqdm(total=args.samples, desc="audit samples", file=sys.stderr, disable=None) as bar:
        report = run_audit(decoder, prompt_ids, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           samples=args.samples, positions=args.positions, seed=args.seed, alpha=args.alpha,
                           progress=lambda i: bar.update(1))
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        lossy = " (LOSSY mode)" if report.lossy else ""
        print(f"audit: drafter={report.drafter} acceptance={report.acceptance}{lossy} temperature={report.temperature} "
              f"top_k={report.top_k} top_p={report.top_p} samples={report.samples}")
        print(f"{'position':>8} {'n':>6} {'chi2':>10} {'dof':>5} {'p-value':>10}")
        for t in report.positions:
            print(f"{t.position:>8} {t.samples:>6} {t.statistic:>10.2f} {t.dof:>5} {t.p_value:>10.4g}")
        print(f"verdict: {report.verdict} (every p-value must be >= alpha/positions = {report.threshold:.4g})")
        print(f"speculation exercised: {report.draft_steps} of {report.steps} steps verified drafts "
              f"({report.drafted} draft tokens, {report.accepted} accepted)")
        if report.drafter != "none" and report.drafted == 0:
            print("warning: no draft was verified, so this audited plain decoding only; with the cost-aware "
                  "controller that happens where drafts do not pay: add --k-policy fixed to audit the drafter",
                  file=sys.stderr)
    return 0 if report.passed else 1


def cmd_compile(args) -> int:
    import time

    import torch

    from ..backends import load_model
    from ..backends import COMPILED_VERIFY_ENV

    if args.threads is not None:
        if args.threads < 1:
            raise InvalidRequest(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target = load_model(args.target, compiled="on")
    step = target.step
    if step is None:
        raise VerispecError("the one-token step did not compile (the warning above says why); decoding stays eager")
    result = {"model": args.target, "compiled": not step.loaded, "seconds": round(step.seconds, 1),
              "total_seconds": round(time.perf_counter() - t0, 1), "path": str(step.path),
              "bytes": step.path.stat().st_size, "verify": None}
    verify = target.verify
    if verify is not None:
        result["verify"] = {"widths": list(verify.widths), "compiled": not verify.loaded,
                            "seconds": round(verify.seconds, 1), "path": str(verify.path),
                            "bytes": verify.path.stat().st_size}
    head = _compile_eagle_head(target)
    result["eagle_head"] = head and {"compiled": not head.loaded, "seconds": round(head.seconds, 1),
                                     "path": str(head.path), "bytes": head.path.stat().st_size}
    if args.json:
        print(json.dumps(result))
    else:
        how = "compiled and stored" if result["compiled"] else "already stored; loaded"
        print(f"{args.target}: one-token step {how} in {result['seconds']} s: {result['path']} "
              f"({result['bytes'] / 1e9:.2f} GB)")
        if verify is not None:
            how = "compiled and stored" if not verify.loaded else "already stored; loaded"
            print(f"{args.target}: {verify.what} {how} in {verify.seconds:.1f} s: {verify.path} "
                  f"({result['verify']['bytes'] / 1e9:.2f} GB)")
        else:
            print(f"{args.target}: verify passes stay eager (a failed compile warns above; -v says when memory is "
                  f"short; {COMPILED_VERIFY_ENV}=0 turns them off)")
        if head is not None:
            how = "compiled and stored" if not head.loaded else "already stored; loaded"
            print(f"{args.target}: the shipped EAGLE head's draft step {how} in {head.seconds:.1f} s: {head.path} "
                  f"({result['eagle_head']['bytes'] / 1e6:.0f} MB)")
    return 0


def _compile_eagle_head(target):
    """The compiled draft step of the EAGLE head shipped for ``target`` (``verispec.eagle.compiled``), loaded or built;
    None where no head ships for it, where the drafter would run the head in bfloat16 (a CPU with bfloat16 dot
    products: the compiled program is float32), or where compiling fails (``compiled_steps`` warns: the torch head
    drafts)."""
    import torch

    from ..eagle.engines import compiled_steps
    from ..drafters.precision import head_dtype
    from ..eagle.head import EagleHead
    from ..eagle.weights import resolve_head

    try:
        folder = resolve_head(target.name, None, prefer_final=target.final_feature_layer is not None)
    except ModelNotFound:
        return None
    if head_dtype("auto", target) != torch.float32:
        return None
    return compiled_steps(EagleHead.load(folder).attach(target.embedding_model), target)


def cmd_cache_prune(args) -> int:
    from ..backends.torch_cpu import compile_store

    if args.max_gb is not None and args.max_gb < 0:
        raise InvalidRequest(f"--max-gb must be >= 0, got {args.max_gb}")
    limit = compile_store.cap_bytes() if args.max_gb is None else int(args.max_gb * 1e9)
    removed = compile_store.prune(limit)
    left = compile_store.records()
    print(f"removed {len(removed)} compiled program(s); {len(left)} left, "
          f"{sum(r.get('bytes', 0) for r in left) / 1e9:.2f} GB in {compile_store.folder()} (limit {limit / 1e9:g} GB)")
    return 0


def cmd_models(args) -> int:
    import torch

    from ..backends.torch_cpu.cpu import cpu_info, linear_kernel
    from ..backends import cache_dir
    from ..backends import PACK_ENV, pack_from_environment

    if args.time:
        from ..backends import load_model
        from ..backends.choice import choose

        picked = choose(args.time, load_model, {"threads": args.threads}, measure=True)
        print(f"{args.time}: {picked.summary()}")
        return 0
    for name, spec in BUILTINS.items():
        cached = (cache_dir() / "models" / name / "config.json").exists()
        print(f"{name:19} {spec.description} [{'cached' if cached else 'fetched on first use'}]"
              + (f"; terms: {spec.terms}" if spec.terms else ""))
    print(f"cache: {cache_dir()} (set VERISPEC_CACHE to move it)")
    cpu = cpu_info()
    print(f"cpu: {cpu['model']} (torch dispatches {cpu['torch_capability']}; flags: {' '.join(cpu['flags']) or '-'})")
    pack = pack_from_environment()
    note = "" if pack else f" ({PACK_ENV}={os.environ.get(PACK_ENV)})"
    for dtype in ("float32", "bfloat16"):
        print(f"linear layers in {dtype}: {linear_kernel(getattr(torch, dtype), pack=pack)}{note}")
    from .. import blockmm

    print("block kernel (--backend blocks): " + (f"{blockmm.isa()}, built from source at install"
                                                  if blockmm.available() else str(blockmm.why_unavailable())))
    print_measurements()
    print_compiled_steps()
    print_openvino_exports()
    return 0


def print_openvino_exports() -> None:
    """The OpenVINO exports (``--backend openvino``) and stored EAGLE head graphs in the cache, with their sizes."""
    from ..backends import cache_dir

    root = cache_dir() / "openvino"
    folders = sorted(p for p in root.glob("*") if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    heads = root / "eagle-heads"
    exports = [p for p in folders if p != heads]
    print(f"openvino exports: {len(exports)} in {root} (delete a folder to export it again)")
    for folder in exports:
        print(f"  {folder.name} · {_size(folder) / 1e6:.0f} MB")
    if heads.is_dir():
        graphs = [p for p in heads.glob("*") if p.is_dir() and not p.name.startswith(".")]
        print(f"  eagle-heads: {len(graphs)} stored head graph(s) · {sum(map(_size, graphs)) / 1e6:.0f} MB")


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def print_compiled_steps() -> None:
    from ..backends.torch_cpu import compile_store

    found = compile_store.records()
    print(f"compiled passes: {len(found)} in {compile_store.folder()} (verispec compile builds a model's; delete a "
          f"file to build it again)")
    for r in found:
        width = r["key"].get("width", 1)
        what = ("one-token step" if width == 1 else width if not str(width)[0].isdigit()
                else f"verify {width} tokens")
        print(f"  {r['model']:18} {r['key'].get('dtype', '')} {what} · built {r['built']} in {r['compile_seconds']} s "
              f"· {r['bytes'] / 1e9:.2f} GB · {Path(r['path']).name}")


def print_measurements() -> None:
    """What later processes start from: the stored step costs and --weights auto's timings."""
    import datetime

    from ..backends import measurements

    if not measurements.enabled():
        print(f"stored measurements: off ({measurements.ENV}={os.environ.get(measurements.ENV)})")
        return
    found = measurements.records()
    print(f"stored measurements: {len(found)} in {measurements.folder()} (--no-cost-cache or "
          f"{measurements.ENV}=0 turns them off; delete a file to measure again)")
    for r in found:
        key = r["key"] or {}
        saved = datetime.datetime.fromtimestamp(r["saved"] or 0).strftime("%Y-%m-%d %H:%M")
        what = ", ".join(str(key[k]) if k in ("model", "what") else f"{k} {key[k]}"
                         for k in ("model", "what", "backend", "dtype", "weights", "compiled", "threads") if k in key)
        if r.get("choice"):  # --weights / --static-widths auto: what it runs, and what it weighed
            candidates = key.get("candidates") or []
            joiner = " or " if any("/" in str(c) for c in candidates) else "/"  # static widths' choices hold a "/"
            weighed = f" of {joiner.join(map(str, candidates))}" if candidates else ""
            what += f", auto chose {r['choice']}{weighed}"
        print(f"  {r['kind']:18} {what} · saved {saved} · {Path(r['path']).name}")


def resolve_auto_backend(args) -> None:
    """``--backend auto`` made concrete before a command runs (every check after it sees the engine that runs), and
    the choice said on stderr."""
    if getattr(args, "backend", None) != "auto":
        return
    from ..backends import load_model
    from ..backends.choice import choose
    from ..backends.registry import options_from

    picked = choose(getattr(args, "target", None) or DEFAULT_MODEL, load_model, options_from(args))
    args.backend = picked.backend
    print(f"verispec: {picked.summary()}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded by bench/analyze results
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="verispec: %(message)s")
    if not args.command:
        parser.print_help()
        return 2
    if getattr(args, "no_cost_cache", False):
        from ..backends.measurements import ENV

        os.environ[ENV] = "0"  # this process and what it starts (Ray replicas get VERISPEC_* variables)
    try:
        resolve_auto_backend(args)
        return args.func(args)
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
