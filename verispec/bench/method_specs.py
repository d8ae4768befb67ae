"""Benchmark methods: verispec configurations and transformers' own generation paths, on one loaded target.

A method spec is a name followed by ``:``-separated parts; a part with ``=`` is an option, any other part
is a model reference:

    baseline                     plain decoding through verispec (drafter none)
    ngram  ngram:k=4:max_n=3     verispec's n-gram drafter, with k and NgramDrafter options
    model:REF  model:REF:k=4     verispec with a separate draft model REF
    eagle  eagle:DIR:k=6         verispec's EAGLE head (the shipped one, or the head folder DIR)
    eagle:tree=1:k=16            the same head drafting a tree of k nodes (:depth=4:width=4)
    eagle:tree=1:lookup=1:k=24   ... with a prompt-lookup branch in the tree (drafter eagle+lookup)
    medusa  medusa:DIR:k=4       verispec's Medusa heads (the shipped set, or the folder DIR); medusa:tree=1:k=10
    hf:greedy                    transformers ``generate`` (greedy or sampling)
    hf:pld  hf:pld:k=10          transformers prompt lookup (``prompt_lookup_num_tokens``, default 10)
    hf:assisted:REF              transformers assisted generation with draft model REF (another tokenizer: its
                                 Universal Assisted Generation)
    llamacpp  llamacpp:lookup     llama-cpp-python's plain generation / prompt lookup (``verispec.bench.llamacpp_peers``)
    openvino  openvino:lookup  openvino:draft=REF  openvino:weights=gguf
                                 OpenVINO GenAI's pipeline: plain, prompt lookup, draft model; on verispec's export or
                                 the GGUF file itself (``verispec.bench.openvino_peers``)
    llama-server  llama-server:spec=ngram-mod[:n_max=16]
                                 llama.cpp's own server, plain or with a speculative type (``verispec.bench.llama_server``)
    arctic:suffix  arctic:suffix:tree=1:k=16
                                 arctic-inference's SuffixDecoding trees drafting for verispec's engine
                                 (``verispec.bench.arctic_peer``; where arctic-inference installs)

verispec methods take per-method target options: ``backend=transformers|llamacpp``, on llama.cpp
``weights=as-is|f32|f16|q8_0|...`` (e.g. ``ngram:backend=llamacpp:weights=f16``) and on transformers
``dtype=float32|bfloat16`` (e.g. ``baseline:dtype=bfloat16``) and ``compile=0|1|auto`` (the compiled one-token step,
``verispec.backends.hf.compiled``; default: the run's ``--compile``), so backends, weight formats, dtypes and kernels compare in
one run; ``llamacpp`` peers take ``weights=`` too.

transformers' methods run the target as transformers loads it, with plain weights (what a transformers user runs),
not verispec's prepacked ones; ``hf:greedy:pack=1`` runs them on the packed weights instead.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers.generation.streamers import BaseStreamer

from ..controller import COST, K_POLICIES
from ..drafters import NONE, drafter_names, get_spec, make_drafter
from ..engine import SpeculativeDecoder
from ..backends.references import default_draft
from ..errors import InvalidRequest
from .method import Method, Run


def parse_spec(spec: str) -> tuple[str, list[str], dict[str, str]]:
    """'model:path:k=4' -> ('model', ['path'], {'k': '4'}); 'hf:assisted:REF' -> ('hf:assisted', ['REF'], {})."""
    parts = [p for p in spec.strip().split(":")]
    if not parts[0]:
        raise InvalidRequest(f"empty method name in {spec!r}")
    head, rest = parts[0], parts[1:]
    if head == "hf":
        if not rest:
            raise InvalidRequest("hf needs a kind: hf:greedy, hf:pld or hf:assisted:REF")
        head, rest = f"hf:{rest[0]}", rest[1:]
    if head in ("llamacpp", "openvino", "arctic") and rest and "=" not in rest[0]:
        head, rest = f"{head}:{rest[0]}", rest[1:]
    refs = [p for p in rest if "=" not in p]
    opts = dict(p.split("=", 1) for p in rest if "=" in p)
    return head, refs, opts


def _number(key: str, value: str):
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            raise InvalidRequest(f"option {key}={value!r} must be a number") from None


def build_method(spec: str, target, load: Callable | None, default_k: int = 8, default_policy: str = COST,
                 threads: int | None = None, llama_server: str | None = None) -> Method:
    """Build a method from its spec; ``load(ref, pack=None, backend=None, weights=None)`` resolves model references
    (shared between methods; None = the run's defaults). verispec methods take ``policy=cost|fixed`` (the
    controller's k policy; default ``default_policy``) and ``backend=``/``weights=`` (their own target).
    ``llama_server`` is the llama-server binary of ``llama-server`` peers (None: found on PATH or installed)."""
    head, refs, raw_opts = parse_spec(spec)
    if head == "llama-server":
        return _llama_server_method(spec, refs, raw_opts, target, load, threads, llama_server)
    if head == "openvino" or head.startswith("openvino:"):
        from .openvino_peers import build_openvino_peer

        if refs:
            raise InvalidRequest(f"{spec!r}: unexpected part {refs[0]!r}; openvino peers take lookup, draft=REF, "
                                 "k=, ngram= and weights=")
        return build_openvino_peer(spec, head.partition(":")[2], raw_opts, target.name, threads,
                                   target.eos_token_ids)
    if head.startswith(("hf:", "llamacpp")) and "policy" in raw_opts:
        raise InvalidRequest(f"{spec!r}: policy is an option of verispec methods, not of {head}")
    backend = raw_opts.pop("backend", None)
    if head.startswith("hf:"):
        for key in ("compile", "compiled"):
            if key in raw_opts:
                raise InvalidRequest(f"{spec!r}: compile= is an option of verispec methods on the transformers "
                                     "backend (transformers' own methods run eagerly)")
        if backend or "weights" in raw_opts:
            raise InvalidRequest(f"{spec!r}: transformers' methods run the transformers backend; drop "
                                 "backend=/weights=")
        load_opts = {}
    else:
        own = "llamacpp" if head.startswith("llamacpp") else backend or target.backend
        load_opts = _load_options(spec, raw_opts, own)
    if head == "llamacpp" or head.startswith("llamacpp:"):
        if backend or refs or set(load_opts) - {"weights"}:
            raise InvalidRequest(f"{spec!r}: llama.cpp peers take k=, ngram= (lookup) and weights= only")
        from .llamacpp_peers import build_llamacpp_peer

        model = load(target.name, backend="llamacpp", weights=load_opts.get("weights") or "as-is")
        opts = {key: _number(key, v) for key, v in raw_opts.items()}
        return build_llamacpp_peer(spec, head.partition(":")[2], opts, model.path, threads, target.eos_token_ids)
    if head.startswith("hf:"):
        return _hf_method(spec, head, refs, {key: _number(key, v) for key, v in raw_opts.items()}, target, load)
    if head == "arctic" or head.startswith("arctic:"):
        if refs:
            raise InvalidRequest(f"{spec!r}: unexpected part {refs[0]!r} (options are written key=value)")
        if backend or load_opts:
            target = load(target.name, backend=backend, **load_opts)
        return _arctic_method(spec, head.partition(":")[2], raw_opts, target, default_k, default_policy)
    name = NONE if head == "baseline" else head
    if name not in drafter_names():
        raise InvalidRequest(f"unknown method {spec!r}; choose baseline, {', '.join(drafter_names()[1:])} (verispec's "
                             "drafters, e.g. ngram:k=4, model:REF, eagle[:DIR]), hf:greedy, hf:pld, hf:assisted:REF, "
                             "llamacpp, llamacpp:lookup, llama-server[:spec=TYPE], openvino, openvino:lookup, "
                             "openvino:draft=REF or arctic:suffix")
    drafter_spec = get_spec(name) if name != NONE else None
    hidden = drafter_spec is not None and drafter_spec.hidden_states
    if hidden:  # llama.cpp needs its callback for layers before the final one (a head's reference names its layers)
        named = dict(raw_opts)
        if refs and drafter_spec.reference_option:
            named[drafter_spec.reference_option] = refs[0]
        hidden = drafter_spec.inner_layers(target.name, named)
    if hidden and not target.supports_features:  # a llama.cpp run: load a copy that gives hidden states
        target = load(target.name, backend=backend, **{**load_opts, "features": True})
    elif backend or load_opts:
        target = load(target.name, backend=backend, features=hidden, **load_opts)
    policy = raw_opts.pop("policy", default_policy)
    if policy not in K_POLICIES:
        raise InvalidRequest(f"{spec!r}: policy must be one of {', '.join(K_POLICIES)}, got {policy!r}")
    k = int(_number("k", raw_opts.pop("k", str(default_k))))
    if drafter_spec is None and raw_opts:
        raise InvalidRequest(f"{spec!r}: plain decoding takes k and policy only, not {', '.join(raw_opts)}")
    options = {key: drafter_spec.option(key).parse(value, spec) for key, value in raw_opts.items()}
    draft = None
    if drafter_spec is not None and drafter_spec.needs_draft_model:
        refs = refs or ([default_draft(target.name)] if default_draft(target.name) else [])
        if len(refs) != 1:
            raise InvalidRequest(f"{spec!r}: the {name} method needs a draft model reference, e.g. {name}:PATH")
        draft = load(refs[0])
    elif refs:
        if drafter_spec is None or not drafter_spec.reference_option or len(refs) > 1:
            raise InvalidRequest(f"{spec!r}: unexpected part {refs[-1]!r} (options are written key=value)")
        options[drafter_spec.reference_option] = refs[0]
    drafter = make_drafter(name, target=target, draft_model=draft, **options)
    if hasattr(drafter, "isolate"):  # drafts from earlier answers: this method's own only, not another method's
        drafter.isolate()
    # no prefix reuse: transformers' generate starts every prompt from an empty cache, so must we
    decoder = SpeculativeDecoder(target, drafter, k=k, reuse_prefix=False, k_policy=policy)
    return Method(spec, _verispec_runner(decoder), "verispec", decoder.drafter_name,
                  k if drafter is not None else None, _kernel(target), target=target,
                  changed_model=target.changed_model)


BENCH_KEYS = {"compile": "compiled", "static": "static_widths"}  # bench spec keys that differ from the load option's


def _load_options(spec: str, opts: dict[str, str], backend: str) -> dict:
    """The backend options a method spec sets (popped from ``opts``), parsed by the option each backend declares;
    one that ``backend`` (the method's own, else the run's) does not take is refused with where it applies."""
    from ..backends import backend_specs, get_backend

    own = get_backend(backend)
    found = {}
    for key in [k for k in opts if BENCH_KEYS.get(k, k) in {o.name for s in backend_specs() for o in s.options}]:
        name, value = BENCH_KEYS.get(key, key), opts.pop(key)
        if not own.takes(name):
            where = [s.name for s in backend_specs() if s.takes(name)]
            raise InvalidRequest(f"{spec!r}: {key}= is an option of the {' and '.join(where)} backend"
                                 f"{'s' if len(where) > 1 else ''}, not {own.name}: add backend={where[0]}"
                                 + (" (on llama.cpp choose weights=)" if name == "dtype" else ""))
        if name == "compiled":
            if value not in ("0", "1", "auto", "on", "off"):
                raise InvalidRequest(f"{spec!r}: compile= takes 0 / off, 1 / on or auto, got {value!r}")
            value = {"0": "off", "1": "on"}.get(value, value)
        found[name] = own.option(name).parse(value, spec)
    return found


def _arctic_method(spec: str, kind: str, opts: dict[str, str], target, default_k: int, default_policy: str) -> Method:
    """arctic-inference's suffix trees drafting for verispec's engine (``verispec.bench.arctic_peer``)."""
    from .arctic_peer import arctic_drafter

    policy = opts.pop("policy", default_policy)
    if policy not in K_POLICIES:
        raise InvalidRequest(f"{spec!r}: policy must be one of {', '.join(K_POLICIES)}, got {policy!r}")
    k = int(_number("k", opts.pop("k", str(default_k))))
    drafter = arctic_drafter(spec, kind, opts)
    decoder = SpeculativeDecoder(target, drafter, k=k, reuse_prefix=False, k_policy=policy)
    return Method(spec, _verispec_runner(decoder), "arctic-inference", drafter.name, k, _kernel(target))


def _llama_server_method(spec: str, refs: list[str], opts: dict[str, str], target, load: Callable, threads,
                         binary: str | None) -> Method:
    from .llama_server import build_llama_server_peer

    if refs:
        raise InvalidRequest(f"{spec!r}: unexpected part {refs[0]!r}; llama-server takes spec=TYPE, its options, "
                             "draft=REF and weights= (e.g. llama-server:spec=ngram-mod:n_max=16)")
    for key in ("backend", "dtype", "compile", "policy", "k"):
        if key in opts:
            raise InvalidRequest(f"{spec!r}: {key}= is not an option of llama-server; it takes spec=TYPE, the "
                                 "type's own options (e.g. n_max=16), draft=REF and weights=")
    model = load(target.name, backend="llamacpp", weights=opts.pop("weights", None) or "as-is")
    draft = opts.pop("draft", None)
    draft_path = load(draft, backend="llamacpp", weights="as-is").path if draft else None
    return build_llama_server_peer(spec, opts, model.path, threads, target.eos_token_ids, binary, draft_path)


def _hf_method(spec: str, head: str, refs: list[str], opts: dict, target, load: Callable | None) -> Method:
    """transformers' own generation paths (``hf:greedy``, ``hf:pld``, ``hf:assisted:REF``)."""
    kind = head[3:]
    extra: dict = {}
    k = None
    if kind == "greedy":
        if refs or set(opts) - {"pack"}:
            raise InvalidRequest(f"{spec!r}: hf:greedy takes no options but pack=0|1")
    elif kind == "pld":
        k = int(opts.pop("k", 10))
        extra = {"prompt_lookup_num_tokens": k}
        if "ngram" in opts:
            extra["max_matching_ngram_size"] = int(opts.pop("ngram"))
    elif kind == "assisted":
        if len(refs) != 1:
            raise InvalidRequest(f"{spec!r}: hf:assisted needs a draft model reference, e.g. hf:assisted:PATH")
        draft = load(refs[0], compiled="off")
        extra = {"assistant_model": draft.model}
        if draft.vocab_size != target.vocab_size:  # its Universal Assisted Generation (as transformers tells them apart)
            extra.update(tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer)
    else:
        raise InvalidRequest(f"unknown transformers method {head!r}; choose hf:greedy, hf:pld or hf:assisted:REF")
    pack = bool(opts.pop("pack", 0))
    if opts:
        raise InvalidRequest(f"{spec!r}: unknown option(s) {', '.join(opts)}")
    if target.backend != "transformers" or target.step is not None:
        # transformers' generate runs its own eager forward: never the compiled copy (or llama.cpp)
        target = load(target.name, pack=None if pack else False, backend="transformers", compiled="off")
    model = target if pack or not target.packed_layers or load is None else load(target.name, pack=False,
                                                                                  compiled=False)
    return Method(spec, _hf_runner(model, extra), "transformers", kind, k, _kernel(model))


def _kernel(target) -> str:
    return f"{target.backend}: {target.kernel}"


def _verispec_runner(decoder: SpeculativeDecoder):
    def run(prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=0) -> Run:
        out = decoder.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                               seed=seed)
        s = out.stats
        steps = list(s.step_seconds)
        if steps:
            steps[0] += s.prefill_seconds
        return Run(out.token_ids, s.wall_seconds, list(s.step_tokens), steps, s.finish_reason, s.lossy,
                   list(s.step_drafted), list(s.step_accepted), list(s.drafted_per_position),
                   list(s.accepted_per_position), s.draft_seconds)

    return run


class _TimingStreamer(BaseStreamer):
    """Records when each batch of new tokens arrives from transformers' generate (the prompt comes first)."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.arrivals.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def _hf_runner(target, extra: dict):
    model, tok = target.model, target.tokenizer
    eos = sorted(target.eos_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)

    @torch.inference_mode()
    def run(prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=0) -> Run:
        ids = torch.tensor([prompt_ids], device=target.device)
        sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=None) if temperature > 0
                    else dict(do_sample=False, temperature=None, top_p=None, top_k=None))
        if temperature > 0:
            torch.manual_seed(seed)  # transformers samples from the global generator
        streamer = _TimingStreamer()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             eos_token_id=eos or None, pad_token_id=pad, streamer=streamer, **sampling, **extra)
        wall = time.perf_counter() - start
        new = out[0, len(prompt_ids):].tolist()
        times = [start] + [t for t, _ in streamer.arrivals]
        steps = [b - a for a, b in zip(times, times[1:])]
        counts = [n for _, n in streamer.arrivals]
        finish = "stop" if new and new[-1] in target.eos_token_ids else "length"
        return Run(new, wall, counts, steps, finish)

    return run
