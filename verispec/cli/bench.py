"""Command line for ``verispec bench`` and ``verispec analyze`` (parsing, progress bars and printing only)."""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
from pathlib import Path

from ..errors import InvalidRequest
from .options import add_backend_options
from ..backends import BUILTINS, DEFAULT_MODEL

DEFAULT_METHODS = "baseline,ngram,hf:pld"


def _prompt_options(p: argparse.ArgumentParser, limit_default: int | None) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--prompts", metavar="FILE|NAME",
                   help="JSONL prompt set: Spec-Bench records {question_id, category, turns} or {\"prompt\": ...} "
                        "lines, or a set shipped with verispec by name: spec-bench (the default: Spec-Bench's 480 "
                        "questions; $VERISPEC_SPECBENCH overrides), code (code_edit and code_generation, 9 each), "
                        "repetition")
    g.add_argument("--categories", metavar="A,B",
                   help="comma-separated groups (mt_bench, translation, summarization, qa, math_reasoning, rag) or "
                        "categories (e.g. writing) (default: all)")
    g.add_argument("--limit", type=int, default=limit_default, metavar="N",
                   help="at most N questions per group or category; mt_bench's eight categories take turns "
                        f"(default: {limit_default or 'all'})")
    g.add_argument("--max-new-tokens", type=int, default=256, help="most new tokens per answer (default: 256)")


def _target_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", default=DEFAULT_MODEL, metavar="REF",
                   help=f"target model: built-in name ({', '.join(BUILTINS)}), local directory, .gguf or hub id "
                        f"(default: {DEFAULT_MODEL})")
    add_backend_options(g, "what runs verispec methods without backend= (a method's own backend=, weights=, "
                           "dtype=, ... override these for it)")


def add_parsers(sub) -> None:
    b = sub.add_parser(
        "bench", help="benchmark methods side by side on Spec-Bench (or any prompt set)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run methods over a prompt set at batch 1, interleaved per question, after a warm-up. Writes "
                    "raw records (records.jsonl), a Markdown table (summary.md), the JSON summary (summary.json) "
                    "and PNG plots to --out; prints the table, and last a one-line JSON summary.",
        epilog="methods (comma-separated; options as :key=value):\n"
               "  baseline            plain decoding through verispec (the reference for speedups)\n"
               "  ngram[:k=8:min_n=2:max_n=4]   verispec's n-gram drafter\n"
               "  (verispec methods also take :policy=cost|fixed, the k policy; default --k-policy)\n"
               "  model:REF[:k=4]     verispec with a separate draft model\n"
               "  eagle[:DIR][:k=8]   verispec's EAGLE head (shipped for the built-in target, or a train-eagle folder)\n"
               "  medusa[:DIR][:k=4][:tree=1]   verispec's Medusa heads (shipped, or a train-medusa folder)\n"
               "  hf:greedy           transformers generate\n"
               "  hf:pld[:k=10]       transformers prompt lookup (prompt_lookup_num_tokens)\n"
               "  hf:assisted:REF     transformers assisted generation with a draft model\n"
               "  llamacpp[:weights=F]           llama-cpp-python's plain generation on the GGUF file\n"
               "  llamacpp:lookup[:k=10:ngram=2] llama-cpp-python's prompt-lookup decoding\n"
               "  openvino[:weights=fp32|int8]   OpenVINO GenAI's pipeline on the model exported to OpenVINO\n"
               "  openvino:lookup[:k=5:ngram=3]  its prompt lookup; openvino:draft=REF[:k=5] its draft-model mode\n"
               "  llama-server[:weights=F]       llama.cpp's own server, plain, on the same GGUF file\n"
               "  llama-server:spec=TYPE[:n_max=16]   ... with --spec-type TYPE (ngram-simple, ngram-map-k, ngram-mod,\n"
               "                      ngram-cache; draft-simple with :draft=REF); options drop the --spec-TYPE- prefix\n"
               "  (verispec methods take :backend=transformers|llamacpp, :weights=as-is|f32|f16|q8_0|... and\n"
               "   :dtype=float32|bfloat16 for their own target, e.g. ngram:backend=llamacpp:weights=f32,\n"
               "   baseline:dtype=bfloat16)\n\n"
               "example: verispec bench --categories summarization,rag --limit 5 --methods baseline,ngram,hf:pld")
    b.add_argument("--methods", default=DEFAULT_METHODS, help=f"methods to compare (default: {DEFAULT_METHODS})")
    b.add_argument("--llama-server", metavar="PATH",
                   help="llama-server binary for the llama-server methods (default: $VERISPEC_LLAMA_SERVER, "
                        "llama-server on PATH, or the one verispec[peers] installs)")
    b.add_argument("--k", type=int, default=8, help="default draft length for verispec methods (default: 8)")
    b.add_argument("--k-policy", default="cost", choices=["cost", "fixed"],
                   help="default k policy of verispec methods (a method's :policy= overrides it): cost (default) "
                        "lets the controller choose the draft length per step, 0 included; fixed verifies up to k")
    _prompt_options(b, limit_default=None)
    _target_options(b)
    g = b.add_argument_group("sampling and output")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, and losslessness is then checked by `verispec audit`")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass for sampling (default: 1)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed for every answer (default: 0)")
    g.add_argument("--warmup", type=int, default=1, help="questions answered untimed first (default: 1)")
    g.add_argument("--reference", metavar="METHOD",
                   help="method that speedups and identical shares are measured against (default: baseline if "
                        "listed, else the first method); e.g. llamacpp, what a CPU user runs without verispec")
    g.add_argument("--out", metavar="DIR", help="results folder (default: bench-results/<UTC time>)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--no-quality", action="store_true",
                   help="skip measuring each verispec method's weights: teacher-forced perplexity on held-out text and "
                        "top-1 agreement with the model's own weights (a few seconds a format; reported beside every "
                        "speed by default, since a re-quantized model is another model)")
    b.set_defaults(func=cmd_bench)


def _setup(args):
    import torch

    from ..backends import get_backend, load_model
    from ..backends.registry import options_from

    if args.threads is not None:
        if args.threads < 1:
            raise InvalidRequest(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.max_new_tokens < 1:
        raise InvalidRequest(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    loaded = {}

    def load(ref: str, backend: str | None = None, **asked):
        """``ref`` on ``backend`` (default: the run's) with the run's options for that backend, the method's own
        (``asked``, None = the run's) over them; loaded once per distinct set."""
        spec = get_backend(backend or args.backend)
        options = {name: value for name, value in options_from(args).items() if spec.takes(name)}
        if asked.get("pack") is False and "compiled" in options:  # transformers' own methods: eager, unpacked
            options["compiled"] = "off"
        if not spec.takes("features"):  # hidden states come without asking on this backend
            asked.pop("features", None)
        options.update({name: value for name, value in asked.items() if value is not None})
        key = (ref, spec.name, tuple(sorted(options.items(), key=lambda item: item[0])))
        if key not in loaded:
            model = load_model(ref, backend=spec.name, **options)
            if hasattr(model, "wait_compiled"):  # a benchmark times the passes as they will run: programs loaded
                model.wait_compiled()
            loaded[key] = model
        return loaded[key]

    return load(args.target), load


def _questions(args):
    from ..bench.prompts import load_questions, select

    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    return select(load_questions(args.prompts), cats, args.limit)


def _out_dir(args, kind: str) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path(f"{kind}-results") / stamp
    out.mkdir(parents=True, exist_ok=True)
    return out


def cmd_bench(args) -> int:
    from ..bench import build_method

    if args.temperature < 0:
        raise InvalidRequest(f"--temperature must be >= 0, got {args.temperature}")
    specs = [s.strip() for s in args.methods.split(",") if s.strip()]
    if not specs:
        raise InvalidRequest("--methods is empty; e.g. --methods baseline,ngram,hf:pld")
    if len(set(specs)) != len(specs):
        raise InvalidRequest("--methods lists a method twice")
    reference = args.reference or ("baseline" if "baseline" in specs else specs[0])
    if reference not in specs:
        raise InvalidRequest(f"--reference {reference!r} is not one of --methods")
    questions = _questions(args)
    target, load = _setup(args)
    methods = []
    try:
        for s in specs:
            methods.append(build_method(s, target, load, default_k=args.k, default_policy=args.k_policy,
                                        threads=args.threads, llama_server=args.llama_server))
        return _run_bench(args, specs, methods, questions, target, reference, load)
    finally:
        for m in methods:
            if m.close is not None:
                m.close()


def method_quality(methods, target, load) -> dict:
    """{method: Quality as a dict} for every verispec method: each distinct target it runs measured once on held-out
    text, its top-1 agreement taken against the model's own weights in float32 on transformers (for a GGUF source,
    the file's values exactly)."""
    from ..bench.quality import held_out_texts, measure, pieces

    own = load(target.name, backend="transformers", dtype="float32", compiled="off")
    texts = pieces(own.tokenizer, held_out_texts())
    _, reference = measure(own, texts)
    measured, out = {}, {}
    for m in methods:
        if m.target is None:
            continue
        if id(m.target) not in measured:
            measured[id(m.target)] = measure(m.target, texts, reference)[0].to_dict()
        out[m.name] = measured[id(m.target)]
    return out


def _run_bench(args, specs, methods, questions, target, reference: str, load) -> int:
    from tqdm import tqdm

    from ..bench import markdown, run_benchmark, summarize
    from ..bench.runner import prompt_encoder
    from ..bench.environment import environment
    from ..bench.plots import acceptance_by_position, speedup_by_group
    from ..engine import SpeculativeDecoder

    encode = prompt_encoder(SpeculativeDecoder(target))
    out = _out_dir(args, "bench")
    total = len(methods) * sum(len(q.turns) for q in questions)
    print(f"bench: {len(questions)} questions, {total} answers, methods {', '.join(specs)}; results in {out}",
          file=sys.stderr)
    records = []
    with open(out / "records.jsonl", "w", encoding="utf-8") as fh, \
            tqdm(total=total, desc="answers", unit="answer", file=sys.stderr, disable=None) as bar:
        for rec in run_benchmark(methods, questions, encode,
                                 lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True),
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                 seed=args.seed, warmup=args.warmup):
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            records.append(rec)
            bar.set_postfix_str(f"{rec['method']} q{rec['question_id']}")
            bar.update(1)
    summary = summarize(records, reference, greedy=args.temperature == 0)
    if not args.no_quality:
        summary["quality"] = method_quality(methods, target, load)
    table = markdown(summary)
    files = {"records": str(out / "records.jsonl"), "table": str(out / "summary.md"),
             "summary": str(out / "summary.json")}
    if not args.no_plots:
        files["speedup_plot"] = str(speedup_by_group(summary, out / "speedup.png"))
        plot = acceptance_by_position(summary, out / "acceptance_by_position.png")
        if plot:
            files["acceptance_plot"] = str(plot)
    result = {
        "command": "verispec " + shlex.join(args.argv),
        "config": {"methods": specs, "target": args.target, "prompts": args.prompts or "spec-bench",
                   "categories": args.categories, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                   "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "k": args.k,
                   "warmup": args.warmup},
        "environment": environment(args.dtype, str(target.device), getattr(target, "packed_layers", 0), target.kernel,
                                   target.backend),
        "files": files,
        **summary,
    }
    env = result["environment"]
    env["method_kernels"] = {m.name: m.kernel for m in methods}
    header = (f"verispec bench · {target.name} · {target.backend} {args.dtype} ({target.kernel}) · {env['cpu']} "
              f"[{env['torch_cpu_capability']}] · {env['torch_threads']} threads · "
              f"max {args.max_new_tokens} new tokens · temperature {args.temperature}\n")
    for m in methods:
        if m.kernel and m.kernel != f"{target.backend}: {target.kernel}":
            header += f"{m.name} runs on {m.kernel}\n"
    if getattr(target, "packed_layers", 0) and any(m.family == "transformers" for m in methods):
        header += "transformers' methods run the plain weights, as transformers loads them (hf:...:pack=1: packed)\n"
    header += "\n"
    (out / "summary.md").write_text(header + table, encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(header + table)
    print(json.dumps(result))
    return 0


def add_analyze_parser(sub) -> None:
    a = sub.add_parser(
        "analyze", help="acceptance analysis: beta per draft position, cost ratio, predicted speedup and optimal k",
        description="Run a drafter at --k-max over a prompt set and measure, without timing noise, the acceptance "
                    "probability per draft position (and, for model drafters, teacher-forced beta = sum min(p, q)); "
                    "measure the draft cost ratio c and the verify cost per number of verified tokens; predict "
                    "speedup(k) = E(k) / (k c + r(k)) and the optimal k. --sweep-k measures the real speedup "
                    "for the same ks beside the prediction (interleaved with plain decoding per question).")
    a.add_argument("--drafter", default="ngram",
                   help="a verispec method spec of any drafter: ngram[:min_n=2:max_n=4], model:REF, eagle[:DIR], "
                        "medusa[:DIR], lookahead, ...; a tree drafter is measured by depth (default: ngram)")
    a.add_argument("--k-max", type=int, default=16, help="draft length of the measuring run; predictions cover "
                                                         "k = 1..k-max (default: 16)")
    _prompt_options(a, limit_default=3)
    _target_options(a)
    a.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    a.add_argument("--repeats", type=int, default=7, help="timed repeats per verify width (default: 7)")
    a.add_argument("--sweep-k", nargs="?", const="1,2,3,4,6,8,12,16", metavar="K,K,...",
                   help="also measure the speedup at these ks (default list when given bare: 1,2,3,4,6,8,12,16)")
    a.add_argument("--out", metavar="DIR", help="results folder (default: analyze-results/<UTC time>)")
    a.set_defaults(func=cmd_analyze)


def _ks(text: str, k_max: int) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise InvalidRequest(f"--sweep-k takes comma-separated whole numbers, got {text!r}") from None
    if not ks or ks[0] < 1 or ks[-1] > k_max:
        raise InvalidRequest(f"--sweep-k values must lie in 1..{k_max} (--k-max)")
    return ks


def cmd_analyze(args) -> int:
    from tqdm import tqdm

    from ..bench import build_method, parse_spec, run_benchmark, summarize
    from ..bench.runner import prompt_encoder
    from ..bench.analyze import (analyze, eagle_teacher_forced_beta, medusa_teacher_forced_beta, teacher_forced_beta,
                                  verify_cost_curve)
    from ..drafters import NONE, drafter_names, get_spec
    from ..bench.plots import analysis_plot
    from ..bench.summary import position_acceptance
    from ..bench.environment import environment
    from ..engine import SpeculativeDecoder
    from ..sampling import SamplingParams

    if not 1 <= args.k_max <= 64:
        raise InvalidRequest(f"--k-max must be in 1..64, got {args.k_max}")
    if args.repeats < 1:
        raise InvalidRequest(f"--repeats must be >= 1, got {args.repeats}")
    head, refs, opts = parse_spec(args.drafter)
    if head not in drafter_names() or head == NONE or "k" in opts:
        raise InvalidRequest(f"--drafter must be a drafter's method spec, one of {', '.join(drafter_names()[1:])} "
                             f"with its options (e.g. ngram:min_n=3, model:REF, eagle:DIR); k comes from --k-max; "
                             f"got {args.drafter!r}")
    spec = get_spec(head)
    typed = {n: spec.option(n).parse(v, f"--drafter {args.drafter}") for n, v in opts.items()
             if n in spec.defaults()}
    tree = spec.drafts_trees({**spec.defaults(), **typed})
    if tree and args.sweep_k:
        raise InvalidRequest(f"--drafter {args.drafter} drafts token trees: analyze measures their acceptance by depth, "
                             "but --sweep-k and the per-k predictions model chains; compare trees with verispec bench")
    sweep = _ks(args.sweep_k, args.k_max) if args.sweep_k else []
    questions = _questions(args)
    target, load = _setup(args)
    sampling = SamplingParams(temperature=args.temperature)
    encode = prompt_encoder(SpeculativeDecoder(target))
    decode = lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    out = _out_dir(args, "analyze")
    # fixed k: every position up to k-max is drafted and verified, so acceptance is measured at each
    spec = f"{args.drafter}:k={args.k_max}:policy=fixed"
    method = build_method(spec, target, load)
    answers = sum(len(q.turns) for q in questions)

    with tqdm(total=answers, desc=f"acceptance run ({spec})", file=sys.stderr, disable=None) as bar:
        records = []
        for rec in run_benchmark([method], questions, encode, decode, args.max_new_tokens,
                                 args.temperature, seed=0, warmup=0):
            records.append(rec)
            bar.update(1)
    steps = [list(zip(r["step_drafted"], r["step_accepted"])) for r in records]

    teacher = None
    if head in ("model", "eagle", "medusa"):  # beta on the first turns' answers, each drafter's q teacher-forced
        first = {r["question_id"]: r["token_ids"] for r in records if r["turn"] == 1}
        seqs = [(encode([{"role": "user", "content": q.turns[0]}]), first[q.question_id]) for q in questions]
        where = {"model": "every position", "eagle": "depth 1", "medusa": "head 1"}[head]
        print(f"teacher-forced beta ({where}) ...", file=sys.stderr)
        if head == "model":
            teacher = teacher_forced_beta(target, load(refs[0]), seqs, sampling)
        elif head == "eagle":
            from ..drafters import EagleDrafter

            teacher = eagle_teacher_forced_beta(target, EagleDrafter(target, refs[0] if refs else None).head, seqs,
                                                sampling)
        else:
            from ..drafters.medusa import MedusaDrafter

            teacher = medusa_teacher_forced_beta(target, MedusaDrafter(target, refs[0] if refs else None).heads, seqs,
                                                 sampling)

    first_rec = records[0]
    context_len = int(statistics.median([r["prompt_tokens"] for r in records])) + args.max_new_tokens // 2
    seed_ids = encode([{"role": "user", "content": questions[0].turns[0]}]) + first_rec["token_ids"]
    context = (seed_ids * (context_len // len(seed_ids) + 1))[:context_len]
    with tqdm(total=(args.repeats + 1) * (args.k_max + 1), desc="verify cost curve", file=sys.stderr,
              disable=None) as bar:
        costs = verify_cost_curve(target, context, args.k_max, args.repeats, sampling, progress=lambda: bar.update(1))
    result = analyze(method.drafter, steps, position_acceptance(records),
                     sum(r["draft_seconds"] or 0.0 for r in records), sum(sum(r["step_drafted"]) for r in records),
                     costs, args.k_max, teacher,
                     ks=() if tree else range(1, args.k_max + 1))

    if sweep:
        base_name = "baseline"
        methods = [build_method(base_name, target, load)] + [
            build_method(f"{args.drafter}:k={k}:policy=fixed", target, load) for k in sweep]
        # and the controller choosing k (0 included) per step, up to k-max
        methods.append(build_method(f"{args.drafter}:k={args.k_max}:policy=cost", target, load))
        with tqdm(total=answers * len(methods), desc="k sweep", file=sys.stderr, disable=None) as bar:
            sweep_records = []
            for rec in run_benchmark(methods, questions, encode, decode, args.max_new_tokens,
                                     args.temperature, seed=0, warmup=1):
                sweep_records.append(rec)
                bar.update(1)
        summary = summarize(sweep_records, base_name, greedy=args.temperature == 0)["overall"]
        result.measured = [{"k": k, "speedup": summary[m.name]["speedup"],
                            "mean_accepted_tokens": summary[m.name]["mean_accepted_tokens"],
                            "identical": summary[m.name]["identical"]}
                           for k, m in zip(sweep, methods[1:])]
        cost = summary[methods[-1].name]
        ctrl = [r for r in sweep_records if r["method"] == methods[-1].name]
        steps = sum(len(r["step_drafted"]) for r in ctrl)
        result.controller = {"method": methods[-1].name, "speedup": cost["speedup"],
                             "mean_accepted_tokens": cost["mean_accepted_tokens"], "identical": cost["identical"],
                             "plain_step_share": sum(r["step_drafted"].count(0) for r in ctrl) / steps if steps else None}
        with open(out / "sweep_records.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in sweep_records)

    from ..controller import shared_cost_curve

    result.learned_cost_ms = {w: 1000 * t for w, t in shared_cost_curve(target).measured().items()}
    text = _analysis_text(result, target.name, args)
    (out / "analysis.md").write_text(text, encoding="utf-8")
    files = {"table": str(out / "analysis.md"), "json": str(out / "analysis.json"),
             "plot": str(analysis_plot(result, out / "analysis.png"))}
    config = {"drafter": args.drafter, "target": args.target, "k_max": args.k_max, "categories": args.categories,
              "limit": args.limit, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "sweep_k": sweep, "context_tokens": context_len}
    payload = {"command": "verispec " + shlex.join(args.argv), "config": config,
               "environment": environment(args.dtype, str(target.device), getattr(target, "packed_layers", 0), target.kernel,
                                   target.backend),
               "files": files, **result.to_dict()}
    (out / "analysis.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")
    print(text)
    print(json.dumps(payload))
    return 0


def _f(x, spec=".3f"):
    return "n/a" if x is None else f"{x:{spec}}"


def _analysis_text(r, target_name: str, args) -> str:
    lines = [f"verispec analyze · {target_name} · drafter {r.drafter} · k-max {r.k_max} · {r.steps} steps · "
             f"{args.dtype} · temperature {args.temperature}", "",
             "Acceptance per draft position (beta_i counts a missing draft as a rejection; P(accept | drafted) "
             "does not)", "",
             "| position i | beta_i | drafts reaching i | P(accept \\| drafted) |", "|---:|---:|---:|---:|"]
    for i, (b, av, c) in enumerate(zip(r.position_betas, r.draft_availability, r.position_acceptance), 1):
        lines.append(f"| {i} | {b:.3f} | {100 * av:.1f}% | {c:.3f} |")
    lines.append("")
    if r.teacher_forced_beta is not None:
        lines.append(f"teacher-forced beta = sum min(p, q) = 1 - TV(p, q): {r.teacher_forced_beta:.3f} "
                     f"(measured beta_1: {r.position_betas[0]:.3f})")
    lines += [f"draft cost ratio c = {r.draft_cost_ratio:.4f} (draft time per drafted token / one plain step of "
              f"{r.verify_cost_ms[0]:.1f} ms)",
              f"geometric approximation uses alpha = {r.geometric_alpha:.3f}", "",
              "E(k) per-position = 1 + beta_1 + beta_1 beta_2 + ... from the k-max run (assumes acceptance at a "
              "position does not depend on k); predicted tokens/step and speedup replay that run's accepted runs "
              "at draft length k (see verispec.analysis.replay_speedup)", "",
              "| k | E(k) per-position | E(k) geometric | predicted tokens/step | verify cost r(k) | "
              "predicted speedup | measured #MAT | measured speedup |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    measured = {m["k"]: m for m in r.measured}
    for p in r.predictions:
        m = measured.get(p["k"], {})
        lines.append(f"| {p['k']} | {p['expected_tokens']:.3f} | {p['expected_tokens_geometric']:.3f} | "
                     f"{p['predicted_tokens_per_step']:.3f} | {p['relative_verify_cost']:.2f} | {p['predicted_speedup']:.3f}x | "
                     f"{_f(m.get('mean_accepted_tokens'))} | {_f(m.get('speedup'))}{'x' if m else ''} |")
    if r.predictions:
        lines += ["", f"predicted optimal k: {r.optimal_k}"]
    else:
        lines += ["", f"a token tree of {r.k_max} nodes: positions are depths in the tree; the per-k predictions model "
                      "chains and are left out (compare trees with verispec bench)"]
    if r.controller:
        c = r.controller
        share = "n/a" if c["plain_step_share"] is None else f"{100 * c['plain_step_share']:.1f}%"
        lines += ["", f"cost-aware controller ({c['method']}, k chosen per step up to {r.k_max}, 0 included): "
                      f"measured speedup {_f(c['speedup'])}x, #MAT {_f(c['mean_accepted_tokens'])}, "
                      f"plain steps {share}"]
    if r.learned_cost_ms:
        lines += ["", "Step cost by width (tokens in the pass): this run's verify cost curve and the controller's "
                      "curve learned online in the same process", "",
                  "| width | verify cost curve (ms) | controller's curve (ms) |", "|---:|---:|---:|"]
        for w in sorted(set(r.learned_cost_ms) | {j + 1 for j in r.verify_cost_ms}):
            measured_ms = r.verify_cost_ms.get(w - 1)
            learned = r.learned_cost_ms.get(w)
            lines.append(f"| {w} | {_f(measured_ms, '.1f')} | {_f(learned, '.1f')} |")
    if r.measured:
        best = max(r.measured, key=lambda m: m["speedup"] or 0)
        lines.append(f"measured best k in the sweep: {best['k']} ({best['speedup']:.3f}x)")
    return "\n".join(lines) + "\n"
