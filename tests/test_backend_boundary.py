"""The target-backend boundary (verispec.backend): the engine, verification, sampling, the audit and the drafters
reach the target only through the protocol, never a backend module; the transformers backend implements it."""

import ast
from pathlib import Path

import torch

from verispec.backend import KVCache, TargetModel

PACKAGE = Path(__file__).resolve().parents[1] / "verispec"
BACKEND_MODULES = {"models", "llamacpp", "cache", "packing"}  # the backends and the transformers backend's parts
BACKEND_FREE = ["engine.py", "verify.py", "sampling.py", "audit.py", "controller.py", "drafters/base.py",
                "drafters/ngram.py", "drafters/model.py", "drafters/eagle.py", "drafters/__init__.py"]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module:
            names.add(node.module.split(".")[-1])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verispec."):
            names.add(node.module.split(".")[-1])
    return names


def test_engine_verify_sampling_and_drafters_import_no_backend():
    for name in BACKEND_FREE:
        found = imported_modules(PACKAGE / name) & BACKEND_MODULES
        assert not found, f"{name} imports backend module(s) {found}"


def test_the_transformers_backend_implements_the_protocol(tiny_target):
    assert isinstance(tiny_target, TargetModel)
    kv = tiny_target.new_kv()
    assert isinstance(kv, KVCache) and len(kv) == 0
    ids = [3, 5, 7, 9, 11]
    full = tiny_target.forward(kv, ids, feature_layers=(0, 1))
    assert full.logits.shape == (5, tiny_target.vocab_size) and full.hidden.shape[:2] == (5, 2)
    kv.truncate(3)
    assert len(kv) == 3
    again = tiny_target.forward(kv, ids[3:], last_only=True)
    assert again.logits.shape == (1, tiny_target.vocab_size) and again.hidden is None
    torch.testing.assert_close(again.logits[0], full.logits[-1], atol=1e-5, rtol=1e-4)
    # a tree of two children of the pending token: each child row equals a chain pass over that child alone
    kv.truncate(3)
    tree = tiny_target.forward(kv, [ids[3], 20, 21], parents=[-1, -1]).logits
    for row, child in ((1, 20), (2, 21)):
        kv.truncate(3)
        chain = tiny_target.forward(kv, [ids[3], child]).logits
        torch.testing.assert_close(tree[row], chain[1], atol=1e-5, rtol=1e-4)
