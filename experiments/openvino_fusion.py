"""Does fusing the projections of one input (q/k/v, gate/up) make verispec's OpenVINO passes cheaper? (issue 35;
docs/openvino.md, "Export")

Copies the cached export of the default model in the given format, traces verispec's graph into the copy once more
with the projections one by one (as before export version 4), loads both, checks that a 6-token pass gives the same
logits, and times passes of 2 and 6 tokens after 300 cached ones, interleaved (median ms).

    python experiments/openvino_fusion.py --weights int4 --rounds 40
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from openvino_knobs import time_passes  # experiments/: run as python experiments/openvino_fusion.py

import verispec.backends.openvino.model as ov_model
from verispec.backends.openvino import export as ov_export
from verispec.backends.references import resolve


def unfused_copy(fused: Path, weights: str) -> Path:
    import openvino as ov
    from transformers import AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="verispec-unfused-")) / fused.name
    shutil.copytree(fused, out)
    model = AutoModelForCausalLM.from_pretrained(resolve("smollm2-135m"), dtype=torch.float32).eval()
    graph = ov_export.trace(model, custom_mask=True)
    ov_export.make_stateful(graph, model.config.num_hidden_layers)
    if weights in ("int8", "int4"):
        graph = ov_export.compress(graph, weights, ov_export.group_size(model.config))
    ov.save_model(graph, out / ov_export.VERISPEC_XML, compress_to_fp16=weights == "fp16")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    fused = ov_export.export_dir("smollm2-135m", args.weights)
    unfused = unfused_copy(fused, args.weights)
    real_export_dir = ov_model.export_dir
    models = {}
    try:
        for name, folder in (("one by one", unfused), ("fused", fused)):
            ov_model.export_dir = lambda ref, weights, folder=folder: folder
            model = ov_model.load("smollm2-135m", args.weights, args.threads)
            model.prepare(width=6)
            kv = model.new_kv()
            model.forward(kv, list(range(100, 400)), last_only=True)
            models[name] = (model, kv)
            print(f"{name}: {model.kernel}", flush=True)
    finally:
        ov_model.export_dir = real_export_dir
        shutil.rmtree(unfused.parent)
    logits = {}
    for name, (model, kv) in models.items():
        logits[name] = model.forward(kv, list(range(500, 506))).logits
        kv.truncate(300)
    diff = (logits["fused"] - logits["one by one"]).abs().max().item()
    print(f"6-token pass: largest logit difference {diff:.3g}, argmax equal "
          f"{torch.equal(logits['fused'].argmax(-1), logits['one by one'].argmax(-1))}")
    times = time_passes(models, args.rounds)
    for name in models:
        print(f"{name:10s} " + ", ".join(f"{w} tokens {times[name, w] * 1e3:.2f} ms" for w in (2, 6)))


if __name__ == "__main__":
    main()
