"""OpenVINO GenAI's LLM pipeline as benchmark peers: what a CPU user runs on Intel-style CPUs without verispec.

    openvino                       plain generation (``openvino_genai.LLMPipeline``) on the model exported to OpenVINO
    openvino:lookup[:k=5:ngram=3]  its prompt-lookup decoding (``prompt_lookup=True``; k = num_assistant_tokens,
                                   ngram = max_ngram_size)
    openvino:draft=REF[:k=5]       its speculative decoding with draft model REF (exported the same way)
    ...:weights=fp32|bf16|fp16|int8|int4  the export's weight format (default fp32; bf16 computes the fp32 export in
                                   bfloat16; int8/int4 compress with NNCF)
    ...:weights=gguf               the model's own GGUF file, read by GenAI itself (``LLMPipeline(FILE.gguf)``: its
                                   reader covers llama, qwen2 and qwen3 files); not with draft=REF (GenAI reads a
                                   draft from an exported folder only)
    ...:kv=f32|f16|bf16|u8         the precision of its KV cache (default: OpenVINO's, u8 on CPUs: lossy, recorded;
                                   bf16 with weights=bf16, the only one its kernel takes there)

The target is exported once into verispec's cache by ``verispec.backends.openvino.export`` (optimum-intel pins an
older transformers). Each peer gets verispec's prompt token ids, starts from an empty cache (a fresh ``generate``,
not chat mode), runs with the run's thread count and the inference precision verispec's backend pins for the same
weights (f32, or bf16 for ``weights=bf16``; OpenVINO's own default is bf16 on CPUs that have it),
stops at the target's end tokens and reports its tokens through a streamer, one call per target step.
"""

from __future__ import annotations

import time

from ..errors import InvalidRequest
from .method import Method, Run

KINDS = ("", "lookup")


def _type_name(t) -> str:
    """'f32' for OpenVINO's element type f32 (its str() is "<Type: 'float32'>")."""
    return t.to_string() if hasattr(t, "to_string") else str(t)


def build_openvino_peer(spec: str, kind: str, opts: dict[str, str], target_ref: str, threads: int | None,
                        eos_ids) -> Method:
    from ..backends.peers import OPENVINO_WEIGHTS as WEIGHTS, default_threads, export_dir, import_openvino, \
        inference_precision
    from ..backends.references import gguf_file

    if kind not in KINDS:
        raise InvalidRequest(f"unknown OpenVINO peer {spec!r}; choose openvino, openvino:lookup or openvino:draft=REF")
    try:
        import openvino_genai as genai
    except ImportError:
        raise InvalidRequest('the openvino peers need openvino-genai; pip install "verispec[openvino]"') from None
    ov = import_openvino()
    weights = opts.pop("weights", "fp32")
    if weights not in (*WEIGHTS, "gguf"):
        raise InvalidRequest(f"{spec!r}: weights= takes {', '.join(WEIGHTS)} or gguf, got {weights!r}")
    kv = opts.pop("kv", None)
    if kv not in (None, "f32", "f16", "bf16", "u8"):
        raise InvalidRequest(f"{spec!r}: kv= takes f32, f16, bf16 or u8, got {kv!r}")
    draft = opts.pop("draft", None)
    if draft and kind:
        raise InvalidRequest(f"{spec!r}: draft=REF and lookup are two different peers; choose one")
    if draft and weights == "gguf":
        raise InvalidRequest(f"{spec!r}: OpenVINO GenAI reads a draft model from an exported folder only, not a GGUF "
                             "file; write weights=as-is (verispec's export of both files' own blocks) for its draft "
                             "pipeline")
    speculative = bool(draft) or kind == "lookup"
    try:
        k = int(opts.pop("k", 5)) if speculative else None
        ngram = int(opts.pop("ngram", 3)) if kind == "lookup" else None
    except ValueError:
        raise InvalidRequest(f"{spec!r}: k= and ngram= take whole numbers") from None
    if opts:
        raise InvalidRequest(f"{spec!r}: unknown option(s) {', '.join(opts)}; openvino peers take weights=, kv=, "
                             "k=, ngram= (lookup) and draft=REF")
    n_threads = threads or default_threads()
    precision = inference_precision("fp32" if weights == "gguf" else weights)
    if precision == "bf16" and kv not in (None, "bf16"):  # its paged-attention kernel checks this mid-generate
        raise InvalidRequest(f"{spec!r}: OpenVINO GenAI computing in bf16 keeps a bf16 KV cache only; drop kv= or "
                             "write kv=bf16")
    props = {"INFERENCE_NUM_THREADS": n_threads, "INFERENCE_PRECISION_HINT": precision,
             **({"KV_CACHE_PRECISION": kv} if kv else {})}
    if kind == "lookup":
        props["prompt_lookup"] = True
    def source(ref: str):  # what GenAI reads: verispec's export, or with weights=gguf the GGUF file itself
        return gguf_file(ref) if weights == "gguf" else export_dir(ref, weights)

    def open_with(build, path):
        try:
            return build(str(path), "CPU", **props)
        except RuntimeError as exc:  # OpenVINO's own message, several lines: its first names the check that failed
            reason = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise InvalidRequest(f"{spec!r}: OpenVINO GenAI could not load {path}: {reason}") from None

    if draft:
        props["draft_model"] = open_with(genai.draft_model, source(draft))
    folder = source(target_ref)
    pipe = open_with(genai.LLMPipeline, folder)
    eos = sorted(eos_ids)
    core = ov.Core()
    kv_name = kv or ("bf16" if precision == "bf16" else _type_name(core.get_property("CPU", "KV_CACHE_PRECISION")))

    class Arrivals(genai.StreamerBase):
        def __init__(self):
            super().__init__()
            self.steps: list[tuple[float, list[int]]] = []

        def write(self, token):
            self.steps.append((time.perf_counter(), [token] if isinstance(token, int) else list(token)))
            return genai.StreamingStatus.RUNNING

        def end(self):
            pass

    def run(prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=0) -> Run:
        import numpy as np

        cfg = pipe.get_generation_config()
        cfg.max_new_tokens = max_new_tokens
        cfg.stop_token_ids = set(eos)
        if eos:
            cfg.eos_token_id = eos[0]
        cfg.do_sample = temperature > 0
        if temperature > 0:
            cfg.temperature, cfg.top_p, cfg.top_k, cfg.rng_seed = temperature, top_p, 0, seed
        if speculative:
            cfg.num_assistant_tokens = k
        if ngram:
            cfg.max_ngram_size = ngram
        streamer = Arrivals()
        start = time.perf_counter()
        result = pipe.generate(ov.Tensor(np.asarray([prompt_ids], dtype=np.int64)), cfg, streamer)
        wall = time.perf_counter() - start
        tokens = [int(t) for t in result.tokens[0]]
        streamed = [t for _, ts in streamer.steps for t in ts]
        counts = [len(ts) for _, ts in streamer.steps]
        times = [start] + [t for t, _ in streamer.steps]
        seconds = [b - a for a, b in zip(times, times[1:])]
        if streamed != tokens[:len(streamed)] or not counts:  # the streamer is only for timing: fall back
            counts, seconds = [1] * len(tokens), [wall / max(1, len(tokens))] * len(tokens)
        elif len(tokens) > len(streamed):  # an end token the streamer did not see came with the last step
            counts[-1] += len(tokens) - len(streamed)
        finish = "stop" if tokens and tokens[-1] in eos_ids else "length"
        return Run(tokens, wall, counts, seconds, finish)

    what = (f"prompt lookup (k={k}, ngram={ngram})" if kind == "lookup" else
            f"draft {draft} (k={k})" if draft else "plain")
    kernel = (f"OpenVINO GenAI {genai.__version__.split('-')[0]}: {folder.name}, {n_threads} threads, "
              f"{precision} inference, {kv_name} KV cache, {what}")
    return Method(spec, run, "openvino", "lookup" if kind else ("model" if draft else "none"), k, kernel)
