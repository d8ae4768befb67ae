"""A GGUF file's tensor table, read from its header alone: each tensor's name, shape, type and bytes (a read-only
memory map), without decoding the metadata. ``gguf.GGUFReader`` decodes every metadata array as well (7 s for the
1.5B's 151,936-token vocabulary on 2 cores); what needs the metadata (the model's configuration, its tokenizer) reads
it through transformers, once."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidRequest

GGUF_CONFIG_FILE = "gguf_config.json"  # beside a file's tokenizer: its configuration as transformers reads it

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` as torch orders it (rows first), ``kind`` the GGUF type's name."""

    name: str
    shape: tuple[int, ...]
    kind: str
    start: int  # where its bytes begin in the file
    nbytes: int
    path: Path

    @property
    def data(self) -> np.ndarray:
        """Its bytes, mapped read-only: uint8 [rows, bytes a row] (a 1-D tensor: [bytes])."""
        rows = self.shape[0] if len(self.shape) > 1 else 1
        shape = (rows, self.nbytes // rows) if len(self.shape) > 1 else (self.nbytes,)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.start, shape=shape)


@dataclass(frozen=True)
class Header:
    architecture: str  # general.architecture: "llama", "qwen2", "gemma3", ...
    tensors: list[TensorInfo]  # in the file's order


def read_header(path: Path) -> Header:
    """The architecture and every tensor of GGUF file ``path``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f:
        def read(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string() -> bytes:
            return f.read(read("Q"))

        def skip_value(kind):
            if kind == _STRING:
                f.seek(read("Q"), 1)
            elif kind == _ARRAY:
                inner, count = read("I"), read("Q")
                if inner in _SCALAR:
                    f.seek(_SCALAR[inner] * count, 1)
                else:
                    for _ in range(count):
                        skip_value(inner)
            else:
                f.seek(_SCALAR[kind], 1)

        if f.read(4) != b"GGUF" or read("I") < 2:
            raise InvalidRequest(f"{path} is not a GGUF file of version 2 or later")
        count, kvs = read("Q"), read("Q")
        alignment, architecture = 32, ""  # GGUF's default alignment, unless general.alignment says otherwise
        for _ in range(kvs):
            key, kind = string(), read("I")
            if key == b"general.alignment" and kind == _UINT32:
                alignment = read("I")
            elif key == b"general.architecture" and kind == _STRING:
                architecture = string().decode()
            else:
                skip_value(kind)
        table = []
        for _ in range(count):
            name = string().decode()
            dims = [read("Q") for _ in range(read("I"))]
            kind = GGMLQuantizationType(read("I"))
            offset = read("Q")
            weights, size = GGML_QUANT_SIZES[kind]
            values = int(np.prod(dims)) if dims else 1
            table.append((name, tuple(int(d) for d in reversed(dims)), kind.name, offset, values // weights * size))
        data = -(-f.tell() // alignment) * alignment
    return Header(architecture, [TensorInfo(name, shape, kind, data + offset, nbytes, path)
                                 for name, shape, kind, offset, nbytes in table])


def type_bytes(path: Path) -> dict[str, int]:
    """The bytes the file holds per tensor type ({"Q4_K": ..., "F32": ...})."""
    mix: dict[str, int] = {}
    for tensor in read_header(path).tensors:
        mix[tensor.kind] = mix.get(tensor.kind, 0) + tensor.nbytes
    return mix
