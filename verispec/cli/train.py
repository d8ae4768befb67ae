"""Command line for ``verispec train-eagle``: self-distillation data, then training, then a held-out check."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from ..errors import InvalidRequest
from ..backends import DEFAULT_MODEL, DTYPES
from ..backends import LoadedModel  # training reads a transformers target
from ..drafters import get_spec


def add_train_parser(sub) -> None:
    t = sub.add_parser(
        "train-eagle", help="train an EAGLE draft head for a target on its own answers",
        description="Train an EAGLE-style draft head for TARGET. 1) The target answers --samples prompts from "
                    "--prompts (greedy, self-distillation; --answers-per-prompt adds sampled answers) and the "
                    "answers are stored in --data (resumable) with its "
                    "hidden states, or as tokens only with --features online (the target then runs over each "
                    "training batch). 2) The head trains on --device (cpu, cuda) with a progress bar, periodic "
                    "validation of top-1 agreement and acceptance (beta) per draft depth, and a checkpoint at each "
                    "validation: Ctrl-C stops it after the current step, --resume goes on. 3) The best head is "
                    "written to --out (model.safetensors + config.json naming the target) and checked in the real "
                    "engine on held-out prompts. Use it with: verispec generate --drafter eagle --eagle-head OUT.",
        epilog="example: verispec train-eagle --prompts data/train-prompts/train_prompts.jsonl --out heads/smollm2")
    _add_data_arguments(t, eagle=True)
    g = t.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=6, help="passes over the data (default: 6)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, cosine decay (default: 1e-3)")
    g.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per step (default: 4096)")
    g.add_argument("--ttt-steps", type=int, default=2, help="draft depths unrolled in training (default: 2)")
    g.add_argument("--answers-only", action="store_true",
                   help="train on answer positions only (default: every position, prompt included, with the "
                        "target's distribution as the label)")
    g.add_argument("--draft-vocab", type=int, default=8192,
                   help="size of the head's reduced vocabulary: the target's most frequent answer tokens (default: 8192)")
    g.add_argument("--init-head", metavar="DIR",
                   help="continue training this head (e.g. after adding data with a larger --samples) instead of "
                        "starting afresh; it keeps its draft vocabulary and reads its --layers or a subset of them (a "
                        "subset starts from its weights with the other layers' fusion columns dropped)")
    g.add_argument("--intermediate-size", type=int, metavar="N",
                   help="hidden units of the head's MLP (default: the target's, 1536 for the default model; a draft "
                        "step streams them, so wider costs drafting time); with --init-head a wider N widens that "
                        "head, its new units starting silent so it begins where the head was")
    g.add_argument("--val-every", type=int, default=200,
                   help="steps between validations, each also writing a resumable checkpoint (default: 200)")
    g.add_argument("--val-sequences", type=int, default=64,
                   help="held-out prompts for validation, chosen by a hash (every answer to each is held out; "
                        "default: 64)")
    _add_run_arguments(g)
    g.add_argument("--check-prompts", type=int, default=8,
                   help="held-out prompts for the final check in the real engine (default: 8; 0 skips it)")
    t.set_defaults(func=cmd_train_eagle)

    m = sub.add_parser(
        "train-medusa", help="train Medusa heads for a target on its own answers",
        description="Train Medusa-1 heads for TARGET: one residual block per head on the target's final hidden "
                    "state, the target's frozen lm_head over a reduced draft vocabulary; head i guesses the token i+2 "
                    "places ahead. 1) The target answers --samples prompts from --prompts (greedy) and its final "
                    "hidden states are cached in --data (resumable; EAGLE data works too; tokens only with "
                    "--features online). 2) The heads train on --device against the target's own distributions (soft "
                    "labels), with a progress bar, validation of top-1 agreement and beta per head, and resumable "
                    "checkpoints (Ctrl-C, then --resume). 3) The best checkpoint is written to --out and checked in the "
                    "real engine on held-out prompts. Use it with: verispec generate --drafter medusa --medusa-heads OUT.",
        epilog="example: verispec train-medusa --prompts data/train-prompts/train_prompts.jsonl --out heads/medusa")
    _add_data_arguments(m, eagle=False)
    g = m.add_argument_group("training")
    g.add_argument("--heads", type=int, default=4, help="Medusa heads, i.e. the longest chain drafted (default: 4)")
    g.add_argument("--head-layers", type=int, default=1, help="residual blocks per head (default: 1)")
    g.add_argument("--epochs", type=int, default=4, help="passes over the data (default: 4)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, cosine decay (default: 1e-3)")
    g.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per step (default: 8192)")
    g.add_argument("--answers-only", action="store_true",
                   help="train on answer positions only (default: every position, prompt included)")
    g.add_argument("--draft-vocab", type=int, default=8192,
                   help="size of the heads' reduced vocabulary: the target's most frequent answer tokens "
                        "(default: 8192)")
    g.add_argument("--init-heads", metavar="DIR",
                   help="continue training these heads (e.g. after adding data) instead of starting afresh; they "
                        "keep their draft vocabulary and head count")
    g.add_argument("--val-every", type=int, default=100,
                   help="steps between validations, each also writing a resumable checkpoint (default: 100)")
    _add_run_arguments(g)
    g.add_argument("--check-prompts", type=int, default=8,
                   help="held-out prompts for the final check in the real engine (default: 8; 0 skips it)")
    m.set_defaults(func=cmd_train_medusa)


def _add_run_arguments(g) -> None:
    g.add_argument("--device", default="cpu", metavar="DEV",
                   help="where the target answers and the head trains: cpu (default), cuda, cuda:1, ...")
    g.add_argument("--features", default="auto", choices=["auto", "cached", "online"],
                   help="cached: store the target's hidden states with the answers (4.6 kB a token for the default "
                        "model) and train from disk; online: store the answers' tokens only and teacher-force each "
                        "batch through the target while training (one target pass per sequence and epoch); auto "
                        "(default): cached on CPU, online elsewhere")
    g.add_argument("--max-minutes", type=float, metavar="M",
                   help="train for at most M minutes: the schedule is fitted to the time after a few steps, and a "
                        "checkpoint lets --resume go on (default: no limit)")
    g.add_argument("--gen-minutes", type=float, metavar="M",
                   help="answer prompts for at most M minutes, then train on the answers so far (a later run "
                        "answers the rest; 0 answers none and trains on the data already there; default: no limit)")
    g.add_argument("--resume", action="store_true",
                   help="go on from the checkpoint.pt a stopped run left in --out (same settings)")


def _add_data_arguments(t, *, eagle: bool) -> None:
    """The target, the prompts, the output folder and step 1's options, shared by train-eagle and train-medusa."""
    t.add_argument("--target", default=DEFAULT_MODEL, metavar="REF", help=f"target model (default: {DEFAULT_MODEL})")
    t.add_argument("--prompts", required=True, metavar="FILE",
                   help="JSONL with a \"prompt\" per line; never the evaluation set (Spec-Bench prompts are refused)")
    t.add_argument("--out", required=True, metavar="DIR", help=f"where the {'head is' if eagle else 'heads are'} written")
    d = t.add_argument_group("self-distillation data")
    d.add_argument("--data", metavar="DIR", help="cache of answers + hidden states (default: a folder under the "
                                                  "verispec cache named after the target and these settings); a "
                                                  "later run with a larger --samples answers only the new prompts"
                                                  + ("" if eagle else "; the data of `train-eagle` serves too"))
    d.add_argument("--samples", type=int, default=2400, help="prompts the target answers (default: 2400)")
    d.add_argument("--max-prompt-tokens", type=int, default=320, help="skip longer prompts (default: 320)")
    d.add_argument("--max-new-tokens", type=int, default=192, help="answer length cap (default: 192)")
    d.add_argument("--gen-dtype", default="auto", choices=["auto", *DTYPES],
                   help="dtype of the target while answering (default: auto, bfloat16 on a GPU and on a CPU that "
                        "multiplies it natively, float32 on other CPUs, where bfloat16 answers 4x slower)")
    d.add_argument("--gen-batch-size", type=int, default=32, help="answers generated together (default: 32)")
    d.add_argument("--gen-backend", default="transformers", choices=["transformers", "llamacpp"],
                   help="what writes the answers: transformers' generate, or llama.cpp's batch engine on the "
                        "target's GGUF weights (F16 unless --gen-dtype says float32; CPU only; measured: docs/eagle.md). "
                        "The hidden states and labels always come from the transformers "
                        "target (default: transformers)")
    d.add_argument("--answers-per-prompt", type=int, default=1, metavar="N",
                   help="answers per prompt: the first greedy, the others sampled at --answer-temperature (default: "
                        "1). More answers from the same prompts: the second set is answered after the first, so a "
                        "run with N=2 over data answered with N=1 adds only the sampled answers")
    d.add_argument("--answer-temperature", type=float, default=0.7, metavar="T",
                   help="temperature of the sampled answers (default: 0.7; no top-k or top-p)")
    if eagle:
        d.add_argument("--layers", metavar="I,J,K",
                       help="target hidden_states indices cached for the head's feature; the final normed state is "
                            "always cached and fused too (default: 2, L/2, L-2 of L layers)")
    d.add_argument("--seed", type=int, default=0, help="prompt selection and training seed (default: 0)")
    x = t.add_argument_group("text corpora (teacher-forced, no answers written)")
    x.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="more training signal from text the target reads: a .jsonl of {\"text\": ...} lines, or a "
                        "file read whole (.txt, .md, code); repeatable. Each is tokenized as it stands, cut into "
                        "sequences of --text-seq-tokens and teacher-forced per batch like --features online data, "
                        "with the target's distribution as the label at every position; training only "
                        "(experiments/offline_corpus.py gathers text found offline)")
    x.add_argument("--text-seq-tokens", type=int, default=512, metavar="N",
                   help="tokens per text sequence (default: 512)")
    x.add_argument("--text-max-tokens", type=int, metavar="N",
                   help="read at most N tokens of text in all (default: all of it)")


def _refuse_eval_prompts(prompts: list[str]) -> None:
    from ..bench.prompts import default_prompts_path, load_questions

    path = default_prompts_path()
    if path is None:
        return
    evaluation = {turn.strip() for q in load_questions(path) for turn in q.turns}
    overlap = sum(1 for p in prompts if p.strip() in evaluation)
    if overlap:
        raise InvalidRequest(f"{overlap} training prompt(s) are Spec-Bench questions, the evaluation set; remove them "
                             "(train on e.g. data/train-prompts/train_prompts.jsonl)")


def _check_whole_numbers(*pairs) -> None:
    for name, value, low in pairs:
        if value < low:
            raise InvalidRequest(f"{name} must be >= {low}, got {value}")


def _self_distillation(args, kind: str) -> tuple[Path, list[list[int]]]:
    """Step 1 of a trainer: the target's answers and hidden states cached on disk (resumable), and the held-out
    prompts for the final check. EAGLE caches its --layers beside the final state; Medusa the final state only."""
    from ..training.data import build_dataset, read_prompts, select_prompts
    from ..backends import cache_dir, load_model

    _check_whole_numbers(("--samples", args.samples, 2), ("--max-new-tokens", args.max_new_tokens, 1),
                         ("--gen-batch-size", args.gen_batch_size, 1), ("--max-prompt-tokens", args.max_prompt_tokens, 2),
                         ("--answers-per-prompt", args.answers_per_prompt, 1))
    if args.answers_per_prompt > 1 and not args.answer_temperature > 0:
        raise InvalidRequest(f"--answer-temperature must be > 0 for sampled answers, got {args.answer_temperature:g}; "
                             "or use --answers-per-prompt 1 (greedy answers only)")
    texts = read_prompts(args.prompts)
    _refuse_eval_prompts(texts)
    device = getattr(args, "device", "cpu")
    gen_backend = getattr(args, "gen_backend", "transformers")
    if gen_backend == "llamacpp" and device != "cpu":
        raise InvalidRequest(f"--gen-backend llamacpp answers on the CPU; with --device {device} leave it out "
                             "(transformers answers on the GPU)")
    if gen_backend == "llamacpp":  # F16 weights unless float32 is asked for (llama.cpp's own dtypes)
        gen_dtype = "float32" if args.gen_dtype == "float32" else "float16"
    else:
        gen_dtype = _gen_dtype(args.gen_dtype, device)
    gen_target = load_model(args.target, dtype="float32" if gen_backend == "llamacpp" else gen_dtype,
                            device=None if device == "cpu" else device)
    layers = _parse_layers(args.layers, gen_target.model.config.num_hidden_layers) if kind == "eagle" else []
    chosen = select_prompts(gen_target, texts, args.samples + args.check_prompts, args.max_prompt_tokens, args.seed)
    train_ids, check_ids = chosen[: args.samples], chosen[args.samples:]
    if len(train_ids) < 2:
        raise InvalidRequest(f"only {len(train_ids)} prompts of at most {args.max_prompt_tokens} tokens; raise "
                             "--max-prompt-tokens or pass more prompts")
    # --samples is not part of the key: a run with more samples extends the same data (prompts are a seeded prefix)
    online = _online(args)
    settings = dict(target=args.target, prompts=str(Path(args.prompts).resolve()), max_prompt=args.max_prompt_tokens,
                    max_new=args.max_new_tokens, layers=[] if online else layers, seed=args.seed, dtype=gen_dtype,
                    **({"features": False} if online else {}),
                    **({"backend": gen_backend} if gen_backend != "transformers" else {}))
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    data_dir = Path(args.data) if args.data else cache_dir() / f"{kind}-data" / f"{Path(args.target).name}-{key}"
    n = args.answers_per_prompt
    asked = train_ids * n  # every prompt's greedy answer first, then each round of sampled ones
    temperatures = [0.0] * len(train_ids) + [args.answer_temperature] * (len(asked) - len(train_ids))
    sampled = f", {len(asked) - len(train_ids)} sampled at temperature {args.answer_temperature:g}" if n > 1 else ""
    print(f"verispec: step 1/3: {len(asked)} answers by {args.target} ({gen_dtype}; {len(train_ids)} greedy"
          f"{sampled}) -> {data_dir}", file=sys.stderr)
    gen_minutes = getattr(args, "gen_minutes", None)
    build_dataset(gen_target, asked, data_dir, layers=tuple(layers), max_new_tokens=args.max_new_tokens,
                  batch_size=args.gen_batch_size, shard_size=max(128, args.gen_batch_size),
                  source=f"{Path(args.prompts).name} (seed {args.seed})",
                  features=not online, max_seconds=None if gen_minutes is None else 60 * gen_minutes,
                  temperatures=temperatures, seed=args.seed,
                  **(_engine_answers(args.target, gen_dtype, args.gen_batch_size,
                                   args.max_prompt_tokens + args.max_new_tokens) if gen_backend == "llamacpp" else {}))
    del gen_target
    return data_dir, check_ids


def _text_corpus(args, target) -> list[Path]:
    """The --text files tokenized for ``target`` (a folder inside --data, or under the verispec cache without it;
    reused while the files stay the same); none without --text."""
    if not args.text:
        return []
    from ..training.corpus import build_text_dataset, corpus_key
    from ..backends import cache_dir

    key = corpus_key(args.text, target.name, args.text_seq_tokens, args.text_max_tokens)
    folder = (Path(args.data) if args.data else cache_dir() / "text-data") / f"text-{Path(target.name).name}-{key}"
    print(f"verispec: reading {len(args.text)} text file(s) -> {folder}", file=sys.stderr)
    return [build_text_dataset(target.tokenizer, target.name, args.text, folder, seq_tokens=args.text_seq_tokens,
                               max_tokens=args.text_max_tokens)]


def _engine_answers(ref: str, dtype: str, batch: int, longest: int) -> dict:
    """build_dataset's ``answer`` and ``answered_by`` for --gen-backend llamacpp: the target's GGUF weights in F16
    (or F32) answering ``batch`` prompts per pass in verispec's batch engine, plain decoding (no drafter), greedy or
    sampled with a seed per prompt. ``longest``: prompt + answer tokens at most (the rows share one context)."""
    from ..engine import SpeculativeDecoder
    from ..backends import load_model
    from ..batching import BatchEngine

    weights = "f32" if dtype == "float32" else "f16"
    model = load_model(ref, backend="llamacpp", weights=weights, sequences=batch + 1)
    batch = max(1, min(batch, model.context_length // longest))

    def answer(prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> list[list[int]]:
        engine = BatchEngine(model, max_batch=batch)
        rows = []
        for j, prompt in enumerate(prompts):  # each its own decoder and seed; the engine runs `batch` at a time
            decoder = SpeculativeDecoder(model, reuse_prefix=False)
            rows.append(engine.submit(decoder, decoder.request(prompt, max_new_tokens=max_new_tokens,
                                                               temperature=temperature, seed=seed + j)))
        engine.run()
        for row in rows:
            if row.error is not None:
                raise row.error
        return [list(row.result.token_ids) for row in rows]

    return {"answer": answer, "answered_by": f"llama.cpp {weights.upper()} batch engine"}


def _gen_dtype(setting: str, device: str) -> str:
    """--gen-dtype auto: bfloat16 on a GPU and on a CPU with bfloat16 dot products; float32 on other CPUs, which
    emulate bfloat16 through float32 and answer several times slower in it (docs/kernels.md)."""
    if setting != "auto":
        return setting
    if device != "cpu":
        return "bfloat16"
    from ..backends.torch_cpu.cpu import bfloat16_dot_products

    return "bfloat16" if bfloat16_dot_products() else "float32"


def _online(args) -> bool:
    """Token-only data teacher-forced while training (--features online, or auto off the CPU)."""
    mode = getattr(args, "features", "cached")
    return mode == "online" or (mode == "auto" and getattr(args, "device", "cpu") != "cpu")


def cmd_train_eagle(args) -> int:
    from ..eagle.train import TrainConfig, train_head
    from ..backends import load_model

    _check_whole_numbers(("--epochs", args.epochs, 1), ("--ttt-steps", args.ttt_steps, 1),
                         ("--draft-vocab", args.draft_vocab, 2), ("--batch-tokens", args.batch_tokens, 64),
                         ("--val-sequences", args.val_sequences, 1))
    _check_run_arguments(args)
    if args.intermediate_size is not None:
        _check_whole_numbers(("--intermediate-size", args.intermediate_size, 1))
    if args.init_head:  # fail before an hour of data generation, not after
        from ..eagle.head import EagleHead

        init = EagleHead.load(args.init_head)
        if args.intermediate_size is not None and args.intermediate_size < init.config.intermediate_size:
            raise InvalidRequest(f"--init-head {args.init_head} has an MLP of {init.config.intermediate_size} units; "
                                 f"--intermediate-size can widen it, not narrow it (got {args.intermediate_size}); "
                                 "leave --init-head out to train a narrower head afresh")
    started = time.perf_counter()
    data_dir, check_ids = _self_distillation(args, "eagle")

    target = load_model(args.target, dtype="float32", device=None if args.device == "cpu" else args.device)
    config = TrainConfig(epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens, ttt_steps=args.ttt_steps,
                         draft_vocab_size=args.draft_vocab, val_every=args.val_every, seed=args.seed,
                         prompt_loss=not args.answers_only, init_head=args.init_head, device=args.device,
                         max_minutes=args.max_minutes, resume=args.resume, val_sequences=args.val_sequences,
                         intermediate_size=args.intermediate_size,
                         feature_layers=_online_layers(args.layers, target.model.config.num_hidden_layers)
                         if _online(args) and args.layers else None)
    text_dirs = _text_corpus(args, target)
    print(f"verispec: step 2/3: training the head -> {args.out}", file=sys.stderr)
    report = train_head(target, data_dir, args.out, config, log=lambda m: print(f"verispec: {m}", file=sys.stderr),
                        text_dirs=text_dirs)
    return _finish(args, target, data_dir, check_ids, report, started, "eagle")


def cmd_train_medusa(args) -> int:
    from ..medusa.train import MedusaTrainConfig, train_medusa
    from ..backends import load_model

    _check_whole_numbers(("--epochs", args.epochs, 1), ("--heads", args.heads, 1), ("--head-layers", args.head_layers, 1),
                         ("--draft-vocab", args.draft_vocab, 2), ("--batch-tokens", args.batch_tokens, 64))
    _check_run_arguments(args)
    if args.init_heads:  # fail before an hour of data generation, not after
        from ..medusa.head import MedusaHeads

        MedusaHeads.load(args.init_heads)
    started = time.perf_counter()
    data_dir, check_ids = _self_distillation(args, "medusa")

    target = load_model(args.target, dtype="float32", device=None if args.device == "cpu" else args.device)
    config = MedusaTrainConfig(num_heads=args.heads, layers=args.head_layers, epochs=args.epochs, lr=args.lr,
                               batch_tokens=args.batch_tokens, draft_vocab_size=args.draft_vocab,
                               val_every=args.val_every, seed=args.seed, prompt_loss=not args.answers_only,
                               init_heads=args.init_heads, device=args.device, max_minutes=args.max_minutes,
                               resume=args.resume)
    text_dirs = _text_corpus(args, target)
    print(f"verispec: step 2/3: training the heads -> {args.out}", file=sys.stderr)
    report = train_medusa(target, data_dir, args.out, config, log=lambda m: print(f"verispec: {m}", file=sys.stderr),
                          text_dirs=text_dirs)
    return _finish(args, target, data_dir, check_ids, report, started, "medusa")


def _check_run_arguments(args) -> None:
    import torch

    device = args.device
    if device != "cpu":
        kind = device.split(":")[0]
        backend = getattr(torch, kind, None)
        if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
            raise InvalidRequest(f"--device {device}: torch sees no such device here (torch {torch.__version__}); "
                                 "use --device cpu or install a torch build for it")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise InvalidRequest(f"--max-minutes must be > 0, got {args.max_minutes:g}")
    if args.gen_minutes is not None and args.gen_minutes < 0:
        raise InvalidRequest(f"--gen-minutes must be >= 0 (0: train on the answers already in --data), "
                             f"got {args.gen_minutes:g}")
    for f in args.text:  # fail before an hour of data generation, not after
        if not Path(f).is_file():
            raise InvalidRequest(f"--text {f} is not a file; pass a .jsonl file of {{\"text\": ...}} lines or a plain "
                                 "text file")
    if args.text_max_tokens is not None and args.text_max_tokens < 1:
        raise InvalidRequest(f"--text-max-tokens must be >= 1, got {args.text_max_tokens}")
    if args.text_seq_tokens < 16:
        raise InvalidRequest(f"--text-seq-tokens must be >= 16, got {args.text_seq_tokens}")
    if args.resume and not (Path(args.out) / "checkpoint.pt").exists():
        raise InvalidRequest(f"--resume: {Path(args.out) / 'checkpoint.pt'} does not exist; start without --resume")


def _finish(args, target, data_dir, check_ids, report, started: float, drafter: str) -> int:
    """Step 3: the trained drafter in the real engine on held-out prompts; a JSON summary on stdout."""
    summary = {"out": str(args.out), "data": str(data_dir), "steps": report.steps,
               "train_seconds": round(report.seconds, 1), "best_validation": report.best,
               "trained_positions_per_second": report.tokens_per_second, "finished": report.finished}
    if not report.finished:
        check_ids = []  # the check is for a finished head; a stopped run goes on with --resume
    if check_ids:
        print(f"verispec: step 3/3: greedy check on {len(check_ids)} held-out prompts", file=sys.stderr)
        check = measure_acceptance(target, drafter, args.out, check_ids)
        summary["held_out_check"] = check
        _record(args.out, "held_out_check", check)
    summary["total_seconds"] = round(time.perf_counter() - started, 1)
    if (Path(args.out) / "config.json").exists():  # a run stopped before its first validation wrote no head yet
        _record(args.out, "total_seconds", summary["total_seconds"])
    print(json.dumps(summary))
    return 0


def _online_layers(text: str, n_layers: int) -> list[int]:
    """--layers read online: the named hidden states, then the final one unless named already (``--layers 30`` of 30
    layers is a head on the final normed state alone, the feature llama.cpp returns without an eval callback)."""
    return list(dict.fromkeys(_parse_layers(text, n_layers) + [n_layers]))


def _parse_layers(text: str | None, n_layers: int) -> list[int]:
    if not text:
        return [2, n_layers // 2, n_layers - 2]
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequest(f"--layers must be comma-separated integers, got {text!r}") from None
    if not layers or any(not 0 <= i <= n_layers for i in layers):
        raise InvalidRequest(f"--layers must name hidden_states indices in 0..{n_layers}, got {text!r}")
    return layers


def _record(out: str | Path, key: str, value) -> None:
    """Add ``key`` to the training record in a trained head's config.json."""
    path = Path(out) / "config.json"
    cfg = json.loads(path.read_text())
    cfg.setdefault("training", {})[key] = value
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def measure_acceptance(target: LoadedModel, drafter: str, head_dir: str | Path, prompts: list[list[int]],
                       k: int | None = None, max_new_tokens: int = 96, progress: bool = True) -> dict:
    """Run the trained ``drafter`` (eagle or medusa, a chain) from ``head_dir`` in the real engine (greedy) on
    held-out prompts: mean accepted tokens per step (#MAT, bonus included) and acceptance per draft position."""
    from tqdm import tqdm

    from ..drafters import make_drafter
    from ..engine import SpeculativeDecoder

    built = make_drafter(drafter, target, **{get_spec(drafter).reference_option: str(head_dir)})
    if k is None:  # a chain of 6 for EAGLE; one position per head for Medusa
        k = built.heads.num_heads if drafter == "medusa" else 6
    # fixed k: every position up to k is drafted and verified, so acceptance is measured at each
    decoder = SpeculativeDecoder(target, built, k=k, reuse_prefix=False, k_policy="fixed")
    steps = tokens = drafted = accepted = 0
    per_drafted = [0] * k
    per_accepted = [0] * k
    for ids in tqdm(prompts, desc="held-out check", unit="prompt", disable=not progress):
        s = decoder.generate(ids, max_new_tokens=max_new_tokens).stats
        steps += s.verify_steps
        tokens += sum(s.step_tokens)
        drafted += s.drafted
        accepted += s.accepted
        for i, (d, a) in enumerate(zip(s.drafted_per_position, s.accepted_per_position)):
            per_drafted[i] += d
            per_accepted[i] += a
    return {"prompts": len(prompts), "k": k, "max_new_tokens": max_new_tokens,
            "mean_accepted_tokens": round(tokens / max(1, steps), 3),
            "acceptance_rate": round(accepted / max(1, drafted), 4),
            "position_acceptance": [round(a / d, 4) if d else None for a, d in zip(per_accepted, per_drafted)]}
