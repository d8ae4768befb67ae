"""What the CPU plugin's own knobs do to an OpenVINO int4 pass (docs/results-archive.md, 2026-11-26 14:24 UTC; issue 35).

    python experiments/openvino_knobs.py                      # every configuration below
    python experiments/openvino_knobs.py base,dq0             # some of them
    python experiments/openvino_knobs.py base,dq64 20         # ... 20 rounds instead of 40

Each configuration loads the default model's int4 export with extra compile properties (dynamic quantization of the
activations off or in groups of 64, 128, 256 or per token instead of the default 32; a u8 or f16 KV cache; TBB's
static or auto partitioner; threads not pinned; one inference thread instead of two), prints the properties the
compiled model reports and whether its passes are width-invariant, then times passes of 2 and 6 tokens at 300
cached tokens, the configurations interleaved (median of 40 rounds unless asked).
"""

import statistics
import sys
import time

import openvino as ov

from verispec.backends.openvino.model import load

CONFIGS = {
    "base": {},
    "dq0": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
    "dq64": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 64},
    "dq128": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 128},
    "dq256": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 256},
    "dqtoken": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": str(2**64 - 1)},  # UINT64_MAX: one group per token
    "tbbstatic": {"TBB_PARTITIONER": "STATIC"},
    "tbbauto": {"TBB_PARTITIONER": "AUTO"},
    "nopin": {"ENABLE_CPU_PINNING": False},
    "thread1": {"INFERENCE_NUM_THREADS": 1},
    "kvu8": {"KV_CACHE_PRECISION": "u8"},
    "kvf16": {"KV_CACHE_PRECISION": "f16"},
}
SHOWN = ("DYNAMIC_QUANTIZATION_GROUP_SIZE", "KV_CACHE_PRECISION", "INFERENCE_PRECISION_HINT", "KEY_CACHE_PRECISION",
         "VALUE_CACHE_PRECISION", "TBB_PARTITIONER", "ENABLE_CPU_PINNING", "INFERENCE_NUM_THREADS")


def main() -> None:
    chosen = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CONFIGS)
    extra: dict = {}
    compile_model = ov.Core.compile_model

    def with_extra(self, model, device=None, config=None):
        return compile_model(self, model, device, {**(config or {}), **extra})

    ov.Core.compile_model = with_extra  # the backend compiles through the Core: every graph gets the extra properties
    models = {}
    for name in chosen:
        extra.clear()
        extra.update(CONFIGS[name])
        model = load("smollm2-135m", weights="int4", threads=2, static_widths=(2, 6))
        compiled = model._paged_requests[(), None].get_compiled_model()
        shown = {p: str(compiled.get_property(p)) for p in SHOWN}
        print(name, shown, "width-invariant", model.width_invariant, flush=True)
        model.prepare(width=6)
        kv = model.new_kv()
        model.forward(kv, list(range(100, 400)), last_only=True)
        models[name] = (model, kv)
    times = time_passes(models, int(sys.argv[2]) if len(sys.argv) > 2 else 40)
    for name in models:
        print(name, " ".join(f"width {w}: {times[name, w] * 1e3:.2f} ms" for w in (2, 6)))


def time_passes(models: dict, rounds: int, widths=(2, 6)) -> dict:
    """Median seconds of a pass of each width after the 300 cached tokens of each (model, cache) in ``models``,
    the models interleaved; each pass is rolled back before the next."""
    times = {(name, w): [] for name in models for w in widths}
    for _ in range(rounds):
        for name, (model, kv) in models.items():
            for w in widths:
                t0 = time.perf_counter()
                model.forward(kv, list(range(500, 500 + w)))
                times[name, w].append(time.perf_counter() - t0)
                kv.truncate(300)
    return {key: statistics.median(ts) for key, ts in times.items()}


if __name__ == "__main__":
    main()
