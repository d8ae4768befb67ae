"""What the per-group zero points of a GGUF's asymmetric blocks (Q4_1, Q5_1, the K-quants) cost an OpenVINO pass
(docs/results-archive.md, 2026-11-29 10:10 UTC; issue 68).

Q4_1 holds w = d * q + m per 32 weights; OpenVINO's compressed-weight chain holds it as d * (q - z) with a float32 zero
point z = -m/d per group. This script copies the as-is export of a model, writes variants of its graph and times the
same passes on each, interleaved:

    zp-f16    the zero points as float16 (rounded: timing only)
    zp-u8     the zero points rounded to u8 (a wrong model: timing only)
    no-zp     the zero points dropped (a wrong model: what the same blocks cost without them)
    split     the exact model with the zero point moved out of the weights: x @ (d * q)^T plus each group's sum of x
              times the group's minimum, one extra small matmul per projection (what llama.cpp's Q4_1 kernel does)

and the int4 re-quantization (NNCF, symmetric, groups of 64) when it is in the cache.

    python experiments/openvino_zero_points.py [--ref smollm2-135m] [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def variants(src: Path, out: Path) -> dict[str, Path]:
    import openvino as ov
    from openvino import opset13 as ops

    core = ov.Core()

    def make(name, change):
        folder = out / name
        shutil.copytree(src, folder)
        model = core.read_model(folder / "verispec_model.xml")
        n = 0
        for op in model.get_ordered_ops():
            if op.get_type_name() != "Subtract":
                continue
            zero = op.input_value(1).get_node()
            if zero.get_type_name() == "Constant" and zero.get_element_type() == ov.Type.f32 \
                    and len(zero.get_output_shape(0)) == 3:
                change(op, zero.get_data())
                n += 1
        model.validate_nodes_and_infer_types()
        ov.save_model(model, folder / "v.xml", compress_to_fp16=False)
        del model
        (folder / "v.xml").replace(folder / "verispec_model.xml")
        (folder / "v.bin").replace(folder / "verispec_model.bin")
        print(f"{name}: {n} zero points changed")
        return folder

    def constant_zero(kind, cast):
        def change(op, zp):
            node = ops.convert(ops.constant(cast(zp), dtype=kind), ov.Type.f32)
            op.input(1).replace_source_output(node.output(0))
        return change

    def drop(op, zp):
        for target in list(op.output(0).get_target_inputs()):
            target.replace_source_output(op.input_value(0))

    def split(op, zp):
        multiply = next(iter(op.output(0).get_target_inputs())).get_node()
        scale_node = multiply.input_value(1).get_node()
        scale = scale_node.get_data() if scale_node.get_type_name() == "Constant" else \
            scale_node.input_value(0).get_node().get_data().astype(np.float32)
        minimum = (-zp[..., 0] * scale[..., 0]).astype(np.float32)  # [rows, groups]
        groups, size = op.get_output_shape(0)[1], op.get_output_shape(0)[2]
        reshape = next(iter(multiply.output(0).get_target_inputs())).get_node()
        multiply.input(0).replace_source_output(op.input_value(0))
        for target in list(reshape.output(0).get_target_inputs()):
            matmul = target.get_node()
            x = matmul.input_value(0)
            rank = len(x.get_partial_shape())
            grouped = ops.reshape(x, ops.constant(np.array([0] * (rank - 1) + [groups, size], dtype=np.int64)),
                                  special_zero=True)
            sums = ops.reduce_sum(grouped, ops.constant(np.array([-1], dtype=np.int64)), keep_dims=False)
            attrs = matmul.get_attributes()
            total = ops.add(ops.matmul(x, reshape.output(0), attrs["transpose_a"], attrs["transpose_b"]),
                            ops.matmul(sums, ops.constant(minimum), False, True))
            for use in list(matmul.output(0).get_target_inputs()):
                use.replace_source_output(total.output(0))

    return {"zp-f16": make("zp-f16", constant_zero(ov.Type.f16, lambda z: z.astype(np.float16))),
            "zp-u8": make("zp-u8", constant_zero(ov.Type.u8, lambda z: np.clip(np.round(z), 0, 255).astype(np.uint8))),
            "no-zp": make("no-zp", drop), "split": make("split", split)}


def main() -> None:
    from transformers import AutoConfig, AutoTokenizer

    from verispec.backends.openvino.export import export_dir
    from verispec.backends.openvino.model import OpenVINOModel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    src = export_dir(args.ref, "as-is")
    work = Path(tempfile.mkdtemp(prefix="zero-points-"))
    folders = {"as-is": src, **variants(src, work)}
    int4 = sorted(src.parent.glob(src.name.replace("-as-is-", "-int4-").rsplit("-", 1)[0] + "-*"))
    if int4:
        folders["int4"] = int4[0]
    models = {}
    for name, folder in folders.items():
        models[name] = OpenVINOModel(folder, AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder),
                                     name, "int4" if name == "int4" else "as-is", 2, "f16", [2], None, "paged", None,
                                     None)
    one = {n: [] for n in models}
    four = {n: [] for n in models}
    answers = {}
    prompt = list(range(100, 160))
    for _ in range(args.rounds):
        for name, model in models.items():
            kv = model.new_kv()
            token = int(model.forward(kv, prompt).logits[-1].argmax())
            tokens = []
            t0 = time.perf_counter()
            for _ in range(args.tokens):
                tokens.append(token)
                token = int(model.forward(kv, [token]).logits[-1].argmax())
            one[name].append((time.perf_counter() - t0) / args.tokens * 1e3)
            answers[name] = tokens
            t0 = time.perf_counter()
            for i in range(20):
                if i:
                    kv.truncate(len(kv) - 4)
                model.forward(kv, tokens[:4])
            four[name].append((time.perf_counter() - t0) / 20 * 1e3)
    print("variant   1-token pass ms (min, median)   4-token pass ms (min)   greedy tokens equal as-is's")
    for name in models:
        print(f"{name:8}  {min(one[name]):6.2f} {np.median(one[name]):6.2f}              {min(four[name]):6.2f}"
              f"                  {answers[name] == answers['as-is']}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
