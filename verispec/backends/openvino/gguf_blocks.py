"""A GGUF file's quantized blocks as OpenVINO compressed weights: the model's own weights, not a re-quantization.

llama.cpp stores a quantized matrix row by row in blocks; each block holds small integers and the factors that turn
them back into weights. OpenVINO's CPU plugin runs a matmul on compressed weights when the weight input is the chain
``Constant(u4 | u8 | i8) -> Convert -> [Subtract(zero point)] -> Multiply(scale) -> Reshape`` with one scale (and
zero point) per group of consecutive input channels. Every block type below maps onto that chain with the block's own
integers and factors:

    type   integers        group  weight                   as OpenVINO holds it                     values
    Q4_0   4-bit           32     d * (q - 8)              u4, zero point 8, f16 scale d             exact
    Q8_0   8-bit signed    32     d * q                    u8 (q + 128), zero point 128, f16 scale   exact
    Q5_0   5-bit           32     d * (q - 16)             u8, zero point 16, f16 scale d            exact
    Q4_1   4-bit           32     d * q + m                u4, f32 zero point -m/d, f16 scale d      within ~1 ulp
    Q5_1   5-bit           32     d * q + m                u8, f32 zero point -m/d, f16 scale d      within ~1 ulp
    Q4_K   4-bit           32     d*sc * q - dmin*mn       u4, f32 zero point, f32 scale d*sc        within ~1 ulp
    Q5_K   5-bit           32     d*sc * q - dmin*mn       u8, f32 zero point, f32 scale d*sc        within ~1 ulp
    Q6_K   6-bit           16     d*sc * (q - 32)          u8, zero point 32, f32 scale d*sc         exact
    F16    half            -      the value                f16 constant, converted                  exact

("within ~1 ulp": OpenVINO's chain subtracts a zero point and then scales, where llama.cpp scales and adds a minimum;
the zero point -m/d is a float32, so a weight can differ from llama.cpp's by a rounding of float32.) 5-bit values are
held in bytes (OpenVINO has no 5-bit type), so Q5 matrices read 8 bits a weight. Other types (Q2_K, Q3_K, the IQ
and TQ families) are not mapped: those matrices stay float32 (the values llama.cpp computes with, dequantized) and
``ConvertedWeights.float32`` names them.

Which GGUF rows a matrix of the exported graph holds is found by value, not by name: each row of the traced graph's
float32 constant (what transformers' GGUF loader dequantized, with every per-architecture reordering it applies,
and the export's fused projections stacked) is looked up among the GGUF rows dequantized by ``gguf``'s own reader.
A matrix whose rows are not all found with one block type stays float32; nothing is replaced on a guess.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass
class Blocks:
    """A matrix's rows as OpenVINO compressed weights: ``q`` [rows, groups, group] (unsigned integers, uint8),
    ``scale`` [rows, groups] and ``zero`` [rows, groups] or a scalar zero point, ``bits`` 4 or 8."""

    kind: str  # the GGUF type's name
    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | float | None
    bits: int

    def take(self, rows: np.ndarray) -> "Blocks":
        zero = self.zero[rows] if isinstance(self.zero, np.ndarray) else self.zero
        return Blocks(self.kind, self.q[rows], self.scale[rows], zero, self.bits)

    def values(self) -> np.ndarray:
        """The weights these blocks hold, [rows, columns] float32, computed as OpenVINO's chain does."""
        q = self.q.astype(np.float32)
        if self.zero is not None:
            zero = self.zero[..., None] if isinstance(self.zero, np.ndarray) else np.float32(self.zero)
            q = q - zero
        return (q * self.scale[..., None].astype(np.float32)).reshape(self.q.shape[0], -1)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """llama.cpp's 32-weight nibble layout: the low nibbles are weights 0-15, the high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's fifth bits (a little-endian uint32 a block) as 0 or 16 for each of the block's 32 weights."""
    bits = qh.copy().view("<u4")[..., 0]
    return (((bits[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _asymmetric(kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int) -> Blocks:
    """Blocks whose weight is d * q + m: OpenVINO's (q - zero) * d with zero = -m / d. A block whose d is 0 holds m
    in every weight: it becomes q = 1, zero 0, scale m."""
    flat = d == 0
    if flat.any():
        q = q.copy()
        q[flat] = 1
        d = np.where(flat, m, d)
        m = np.where(flat, 0, m)
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(d == 0, 0, -m / d).astype(np.float32)
    return Blocks(kind, q, d.astype(np.float32), zero, bits)


def _q4_0(b):
    return Blocks("Q4_0", _nibbles(b[..., 2:18]), _f16(b[..., 0:2]), 8.0, 4)


def _q4_1(b):
    return _asymmetric("Q4_1", _nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4)


def _q5_0(b):
    return Blocks("Q5_0", _nibbles(b[..., 6:22]) | _high_bits(b[..., 2:6]), _f16(b[..., 0:2]), 16.0, 8)


def _q5_1(b):
    q = _nibbles(b[..., 8:24]) | _high_bits(b[..., 4:8])
    return _asymmetric("Q5_1", q, _f16(b[..., 0:2]), _f16(b[..., 2:4]), 8)


def _q8_0(b):
    # held unsigned with zero point 128: OpenVINO's CPU kernels ran signed groups slower than unsigned ones on wide
    # matrices (docs/openvino.md, "A GGUF's own blocks")
    return Blocks("Q8_0", (b[..., 2:34].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8),
                  _f16(b[..., 0:2]), 128.0, 8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's eight 6-bit scales and minimums of a super-block, from its 12 bytes (llama.cpp's
    ``get_scale_min_k4``)."""
    s = s.astype(np.uint8)
    low = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return low.astype(np.float32), mins.astype(np.float32)


def _k_asymmetric(kind: str, b: np.ndarray, q: np.ndarray, bits: int) -> Blocks:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    shape = (*b.shape[:-1], 8)  # [..., super-blocks, 8 groups of 32]
    q = q.reshape(*shape, 32)
    blocks = _asymmetric(kind, q, (d[..., None] * sc).reshape(shape), (-dmin[..., None] * mn).reshape(shape), bits)
    return blocks


def _q4_k(b):
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # four chunks of 64 weights: low nibbles, then high
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # [..., 4, 2, 32]
    return _k_asymmetric("Q4_K", b, q, 4)


def _q5_k(b):
    qh = b[..., 16:48]  # bit 2j / 2j+1 of byte l: the fifth bit of weight l of chunk j's first / second 32
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
    high = ((qh[..., None, None, :] >> shifts) & 1) << 4  # [..., 4, 2, 32]
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2) | high
    return _k_asymmetric("Q5_K", b, q, 8)


def _q6_k(b):
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 64)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32)
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # 16 groups of 16
    d = _f16(b[..., 208:210])
    parts = [(ql[..., 0:32] & 0x0F) | (((qh >> 0) & 3) << 4), (ql[..., 32:64] & 0x0F) | (((qh >> 2) & 3) << 4),
             (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4)]
    q = np.stack(parts, axis=-2).reshape(*b.shape[:-1], 16, 16)  # [..., 2 halves, 4 parts, 32] as 16 groups
    return Blocks("Q6_K", q.astype(np.uint8), d[..., None] * sc, 32.0, 8)


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def decode(kind: str, raw: np.ndarray) -> Blocks:
    """The blocks of a matrix of GGUF type ``kind`` as OpenVINO-ready integers and factors; ``raw`` is the tensor's
    bytes as ``gguf.GGUFReader`` gives them, [rows, bytes a row]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows = raw.shape[0]
    blocks = DECODERS[kind](raw.reshape(rows, -1, size))  # [rows, blocks, ...]
    groups = blocks.q.shape[1] * (blocks.q.shape[2] if blocks.q.ndim == 4 else 1)
    group = blocks.q.shape[-1]
    assert groups * group == raw.shape[1] // size * block, (kind, blocks.q.shape)
    zero = blocks.zero.reshape(rows, groups) if isinstance(blocks.zero, np.ndarray) else blocks.zero
    return Blocks(kind, blocks.q.reshape(rows, groups, group), blocks.scale.reshape(rows, groups), zero, blocks.bits)


def _row_keys(values: np.ndarray) -> list[bytes]:
    """A 16-byte key per row of ``values`` [rows, columns] from its float32 bytes: the native kernel's digests where it
    is built (memory speed: the 1.5B's 1.7 million rows in about a second), else blake2b a row (~20 s there)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    from ... import blockmm

    if blockmm.native_built():
        return blockmm.row_digests(torch.from_numpy(values))
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in values]


@dataclass
class GGUFRows:
    """Every row of a GGUF file's 2-D quantized (and F16) tensors, findable by its dequantized float32 values."""

    path: Path
    where: dict[bytes, tuple[str, int]] = field(default_factory=dict)  # row's values -> (tensor, row)
    kinds: dict[str, str] = field(default_factory=dict)  # tensor -> type name
    raw: dict[str, np.ndarray] = field(default_factory=dict)  # tensor -> its bytes [rows, bytes a row]
    _decoded: dict[str, "Blocks | np.ndarray"] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> "GGUFRows":
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from ..gguf_header import read_header

        found = cls(Path(path))
        for tensor in read_header(Path(path)).tensors:  # the tensor table alone: gguf's reader decodes the vocabulary
            kind = tensor.kind
            if len(tensor.shape) != 2 or (kind not in DECODERS and kind != "F16"):
                continue
            raw = np.asarray(tensor.data)  # [rows, bytes a row]
            rows = dequantize(raw, GGMLQuantizationType[kind]).reshape(tensor.shape)
            found.add(tensor.name, kind, raw, rows)
        return found

    def add(self, name: str, kind: str, raw: np.ndarray, values: np.ndarray) -> None:
        """Hold tensor ``name`` of GGUF type ``kind``: its bytes [rows, bytes a row] and dequantized ``values``
        [rows, columns] (how its rows are found)."""
        self.kinds[name], self.raw[name] = kind, raw
        for i, key in enumerate(_row_keys(values)):
            self.where.setdefault(key, (name, i))

    def blocks(self, name: str) -> "Blocks | np.ndarray":
        """The tensor's blocks (an F16 tensor: its float16 values)."""
        if name not in self._decoded:
            kind, raw = self.kinds[name], self.raw[name]
            self._decoded[name] = raw.view(np.float16) if kind == "F16" else decode(kind, raw)
        return self._decoded[name]

    def locate(self, matrix: np.ndarray) -> list[tuple[str, int]] | None:
        """Where each row of ``matrix`` [rows, columns] is in the file, or None if one row is nowhere."""
        found = []
        for key in _row_keys(matrix):
            hit = self.where.get(key)
            if hit is None:
                return None
            found.append(hit)
        return found

    def kind_of(self, matrix: np.ndarray) -> str | None:
        """The one GGUF type all of ``matrix``'s rows are stored in, or None (rows not found, or of several types)."""
        places = self.locate(matrix)
        kinds = {self.kinds[t] for t, _ in places} if places else set()
        return kinds.pop() if len(kinds) == 1 else None

    def gather(self, matrix: np.ndarray) -> "Blocks | np.ndarray | None":
        """``matrix``'s rows as the file stores them: Blocks, float16 values, or None where they are not all found
        in tensors of one type."""
        places = self.locate(matrix)
        if places is None or len({self.kinds[t] for t, _ in places}) != 1:
            return None
        parts, rows = [], []
        for name in dict.fromkeys(t for t, _ in places):  # each tensor once, in order of first use
            rows.append(np.asarray([r for t, r in places if t == name]))
            parts.append(self.blocks(name))
        if isinstance(parts[0], np.ndarray):
            picked = [p[r] for p, r in zip(parts, rows)]
            out = np.concatenate(picked)
        else:
            picked = [p.take(r) for p, r in zip(parts, rows)]
            zero = picked[0].zero if not isinstance(picked[0].zero, np.ndarray) else \
                np.concatenate([p.zero for p in picked])
            out = Blocks(picked[0].kind, np.concatenate([p.q for p in picked]),
                         np.concatenate([p.scale for p in picked]), zero, picked[0].bits)
        # rows are taken tensor by tensor: put them back in the matrix's order
        order = np.concatenate([np.flatnonzero([t == name for t, _ in places]) for name in dict.fromkeys(
            t for t, _ in places)])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return out[inverse] if isinstance(out, np.ndarray) else out.take(inverse)


def _chain(ov, blocks: "Blocks | np.ndarray", shape):
    """The compressed-weight chain OpenVINO's CPU plugin runs matmuls on, holding ``blocks``, shaped ``shape``."""
    from openvino import opset13 as ops

    if isinstance(blocks, np.ndarray):  # F16: half-precision values, converted once when the graph compiles
        return ops.convert(ops.constant(np.ascontiguousarray(blocks), dtype=ov.Type.f16), ov.Type.f32)
    kind = ov.Type.u4 if blocks.bits == 4 else ov.Type.u8
    weight = ops.convert(ops.constant(np.ascontiguousarray(blocks.q), dtype=kind), ov.Type.f32)
    if isinstance(blocks.zero, np.ndarray):
        weight = ops.subtract(weight, ops.constant(blocks.zero[..., None].astype(np.float32), dtype=ov.Type.f32))
    elif blocks.zero is not None:
        zero = ops.constant(np.array([[[blocks.zero]]], dtype=np.uint8), dtype=kind)
        weight = ops.subtract(weight, ops.convert(zero, ov.Type.f32))
    # scales that are float16 values (the 32-weight types' d) stay float16; products of two factors need float32
    scale = blocks.scale[..., None]
    exact16 = np.array_equal(scale.astype(np.float16).astype(np.float32), scale)
    scale_node = (ops.convert(ops.constant(scale.astype(np.float16), dtype=ov.Type.f16), ov.Type.f32) if exact16
                  else ops.constant(scale.astype(np.float32), dtype=ov.Type.f32))
    weight = ops.multiply(weight, scale_node)
    return ops.reshape(weight, ops.constant(np.asarray(shape, dtype=np.int64)), special_zero=False)


@dataclass
class ConvertedWeights:
    """What ``compress_from_gguf`` did: matrices held in each GGUF type, and those left float32 (with their
    shapes)."""

    kinds: dict[str, int] = field(default_factory=dict)
    float32: list[str] = field(default_factory=list)

    def summary(self) -> str:
        held = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
        return f"{held or 'no matrix'} as the GGUF stores them" + (
            f"; {len(self.float32)} left float32 ({', '.join(self.float32[:4])}{' ...' if len(self.float32) > 4 else ''})"
            if self.float32 else "")


def compress_from_gguf(ov_model, rows: GGUFRows, check: bool = True) -> ConvertedWeights:
    """Replace every 2-D float32 weight constant of ``ov_model`` (matmuls, embedding gathers) whose rows the GGUF file
    holds with the file's own blocks. ``check``: each replaced matrix's decompressed values must equal the float32
    constant's within float32 rounding (they are the same numbers), or it stays float32."""
    import openvino as ov

    done = ConvertedWeights()
    seen = set()
    for op in ov_model.get_ordered_ops():
        if op.get_type_name() not in ("MatMul", "Gather"):
            continue
        for port in op.inputs():
            source = port.get_source_output()
            const = source.get_node()
            if const.get_type_name() != "Constant" or const.get_element_type() != ov.Type.f32 \
                    or len(const.get_output_shape(0)) != 2 or id(const) in seen:
                continue
            matrix = const.get_data()
            if matrix.shape[0] < 2 or matrix.shape[1] < 16:
                continue  # an index or a scalar-like constant, not a weight matrix
            seen.add(id(const))
            blocks = rows.gather(matrix)
            name = const.get_friendly_name()
            if blocks is None:
                done.float32.append(f"{name} {tuple(matrix.shape)}")
                continue
            if check:
                held = blocks.astype(np.float32) if isinstance(blocks, np.ndarray) else blocks.values()
                tol = 4 * np.finfo(np.float32).eps * np.abs(matrix).max(axis=1, keepdims=True)
                if not np.all(np.abs(held - matrix) <= tol):
                    log.warning("%s: the GGUF blocks do not reproduce its values; it stays float32", name)
                    done.float32.append(f"{name} {tuple(matrix.shape)}")
                    continue
            chain = _chain(ov, blocks, matrix.shape)
            for target in list(source.get_target_inputs()):
                target.replace_source_output(chain.output(0))
            kind = "F16" if isinstance(blocks, np.ndarray) else blocks.kind
            done.kinds[kind] = done.kinds.get(kind, 0) + 1
    ov_model.validate_nodes_and_infer_types()
    return done
