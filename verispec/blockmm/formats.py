"""The GGUF block types the native kernel multiplies: llama.cpp's layouts, named and numbered as ggml names them.

    type   weights  bytes  weight                      integers held          sub-scales
    Q4_0   32       18     d * (q - 8)                 q 0..15                 -
    Q4_1   32       20     d * q + m                   q 0..15                 -
    Q5_0   32       22     d * (q - 16)                q 0..31                 -
    Q8_0   32       34     d * q                       q -128..127             -
    Q4_K   256      144    d * sc * q - dmin * mn      q 0..15                 6-bit sc, mn per 32
    Q5_K   256      176    d * sc * q - dmin * mn      q 0..31                 6-bit sc, mn per 32
    Q6_K   256      210    d * sc * (q - 32)           q - 32: -32..31         int8 sc per 16

These are every matrix type of the four built-in models' files (``verispec models`` lists them). Other types (Q2_K,
Q3_K, Q5_1, the IQ and TQ families, F16) are not multiplied natively: a model holding them runs those matrices
dequantized to float32 (``verispec.blockmm.linear``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockType:
    name: str
    ggml_id: int  # ggml's type number, the native kernel's name for it
    weights: int  # weights a block
    bytes: int  # bytes a block

    def row_bytes(self, columns: int) -> int:
        if columns % self.weights:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.weights}; {columns} columns is not one")
        return columns // self.weights * self.bytes


TYPES = {t.name: t for t in (
    BlockType("Q4_0", 2, 32, 18),
    BlockType("Q4_1", 3, 32, 20),
    BlockType("Q5_0", 6, 32, 22),
    BlockType("Q8_0", 8, 32, 34),
    BlockType("Q4_K", 12, 256, 144),
    BlockType("Q5_K", 13, 256, 176),
    BlockType("Q6_K", 14, 256, 210),
)}


def block_type(name: str) -> BlockType:
    try:
        return TYPES[name]
    except KeyError:
        raise ValueError(f"block type {name!r} has no native kernel; supported: {', '.join(TYPES)}") from None
