"""Command line: ``verispec generate | audit | bench | analyze | bench-serve | serve | models``. Argument parsing and
printing live in the cli*.py modules, never in the library."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__
from .cli_backend import add_backend_options, load_args_model
from .cli_bench import add_analyze_parser, add_parsers as add_bench_parsers
from .cli_load import add_bench_serve_parser
from .cli_serve import add_serve_parser
from .cli_train import add_train_parser
from .drafters import DRAFTERS
from .errors import VerispecError
from .models import BUILTINS, DEFAULT_MODEL, DTYPES

# Raw repetitive text: the n-gram drafter proposes at every tested position and the target's next-token
# distribution is spread out, so a lossy acceptance rule shows up within ~100 samples.
DEFAULT_AUDIT_PROMPT = "one two three four five one two three four five one two"


def _model_options(p: argparse.ArgumentParser, drafter_default: str = "ngram") -> None:
    g = p.add_argument_group("model and drafter")
    g.add_argument("--target", default=DEFAULT_MODEL, metavar="REF",
                   help=f"target model: built-in name ({', '.join(BUILTINS)}), local directory, .gguf file or "
                        f"hub id (default: {DEFAULT_MODEL})")
    g.add_argument("--drafter", default=drafter_default, choices=DRAFTERS,
                   help=f"who proposes tokens: none = plain decoding (the off switch), ngram = prompt lookup, "
                        f"model = a separate draft model, eagle = a trained head on the target's hidden states "
                        f"(default: {drafter_default})")
    g.add_argument("--draft-model", metavar="REF", help="draft model for --drafter model (same tokenizer as the target)")
    g.add_argument("--eagle-head", metavar="DIR",
                   help="head for --drafter eagle, as written by `verispec train-eagle` (default: the head shipped "
                        "for the built-in target)")
    g.add_argument("--eagle-tree", action="store_true",
                   help="with --drafter eagle, draft a tree of --k candidate tokens (EAGLE-2 style) instead of a "
                        "chain, verified losslessly at any temperature")
    g.add_argument("--eagle-lookup", action="store_true",
                   help="with --eagle-tree, add a prompt-lookup (n-gram) branch to each tree (drafter 'eagle+lookup')")
    g.add_argument("--eagle-depth", type=int, default=4, help="depth of the eagle tree (default: 4)")
    g.add_argument("--eagle-width", type=int, default=4,
                   help="children per expanded node and nodes expanded per depth in the eagle tree (default: 4)")
    g.add_argument("--k", type=int, default=8, help="most draft tokens verified per step (default: 8)")
    g.add_argument("--k-policy", default="cost", choices=["cost", "fixed"],
                   help="cost (default): choose each step how many draft tokens to verify, 0 included, from step "
                        "costs and acceptance measured on this machine; fixed: verify every draft token offered, "
                        "up to --k (for experiments)")
    g.add_argument("--ngram-min", type=int, default=2, help="shortest suffix n-gram the ngram drafter matches (default: 2)")
    g.add_argument("--ngram-max", type=int, default=4, help="longest suffix n-gram the ngram drafter matches (default: 4)")
    g.add_argument("--ngram-branches", type=int, default=1,
                   help="with more than 1, the ngram drafter proposes a tree of what followed that many earlier "
                        "matches (default: 1, a chain)")
    g.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="weights and activations; float32 (default) guarantees greedy output identical to plain "
                        "decoding, bfloat16 only approximately (rounding differs between wide and narrow passes)")
    g.add_argument("--acceptance", default="strict", choices=["strict", "typical"],
                   help="strict = rejection sampling, lossless (default); typical = Medusa-style typical "
                        "acceptance, LOSSY: faster but no longer the target's distribution")
    add_backend_options(g)


def _sampling_options(p: argparse.ArgumentParser, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 = greedy; > 0 samples (default: {temperature})")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off, default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off, default)")


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
    _model_options(gen)
    _sampling_options(gen, temperature=0.0)
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
    _model_options(aud)
    _sampling_options(aud, temperature=1.0)
    aud.add_argument("--samples", type=int, default=300, help="continuations to draw (default: 300)")
    aud.add_argument("--positions", type=int, default=3, help="token positions tested per continuation (default: 3)")
    aud.add_argument("--alpha", type=float, default=0.01, help="family-wise significance level (default: 0.01)")
    aud.add_argument("--seed", type=int, default=0, help="first seed; sample i uses seed+i (default: 0)")
    aud.add_argument("--json", action="store_true", help="print the report as one JSON object")
    aud.set_defaults(func=cmd_audit)

    add_bench_parsers(sub)
    add_analyze_parser(sub)
    add_bench_serve_parser(sub)
    add_serve_parser(sub, _model_options)
    add_train_parser(sub)

    mod = sub.add_parser("models", help="list built-in models and where they are cached")
    mod.set_defaults(func=cmd_models)
    return parser


def eagle_options(args) -> dict:
    return {"head": args.eagle_head, "tree": args.eagle_tree, "depth": args.eagle_depth, "width": args.eagle_width,
            "lookup": args.eagle_lookup}


def _build_decoder(args):
    from .drafters import make_drafter
    from .engine import SpeculativeDecoder

    target = load_args_model(args, args.target)
    options = {}
    draft_model = None
    if args.drafter == "ngram":
        options = {"min_n": args.ngram_min, "max_n": args.ngram_max, "branches": args.ngram_branches}
    elif args.drafter == "model" and args.draft_model:
        draft_model = load_args_model(args, args.draft_model)
    elif args.drafter == "eagle":
        options = eagle_options(args)
    drafter = make_drafter(args.drafter, target=target, draft_model=draft_model, **options)
    return SpeculativeDecoder(target, drafter, k=args.k, acceptance=args.acceptance, k_policy=args.k_policy)


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    decoder = _build_decoder(args)
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

    from .audit import run_audit

    decoder = _build_decoder(args)
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


def cmd_models(args) -> int:
    import os

    import torch

    from .cpu import cpu_info, linear_kernel
    from .models import PACK_ENV, cache_dir, pack_from_environment

    for name, spec in BUILTINS.items():
        cached = (cache_dir() / "models" / name / "config.json").exists()
        print(f"{name:16} {spec.description} [{'cached' if cached else 'fetched on first use'}]")
    print(f"cache: {cache_dir()} (set VERISPEC_CACHE to move it)")
    cpu = cpu_info()
    print(f"cpu: {cpu['model']} (torch dispatches {cpu['torch_capability']}; flags: {' '.join(cpu['flags']) or '-'})")
    pack = pack_from_environment()
    note = "" if pack else f" ({PACK_ENV}={os.environ.get(PACK_ENV)})"
    for dtype in ("float32", "bfloat16"):
        print(f"linear layers in {dtype}: {linear_kernel(getattr(torch, dtype), pack=pack)}{note}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded by bench/analyze results
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="verispec: %(message)s")
    if not args.command:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
