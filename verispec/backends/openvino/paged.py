"""Paged attention on the OpenVINO backend: the graph OpenVINO GenAI's own pipelines run, with a cache verispec owns.

OpenVINO's ``paged_attention_transformation`` rewrites the exported graph's attention into its ``PagedAttention``
op: the keys and values live in blocks of a fixed number of positions (32 on CPUs), in tensors the caller hands to
the infer request (``key_cache.N``, ``value_cache.N``), and each pass names, per sequence, its cached length
(``past_lens``) and its blocks (``block_indices``). Its CPU kernel is faster than the stateful graph's attention,
wide passes most of all (docs/openvino.md).

What verispec gets from it:

- rollback is free: ``truncate`` lowers the sequence's length (and frees whole blocks past it); the next pass
  writes over the dropped positions;
- several sequences share one pass (``subsequence_begins``): the batch engine's passes are truly batched;
- a prefix copy is a copy of the prefix's blocks.

The attention is causal only, so token trees (which need each node to see its ancestors only) run the stateful graph
with the 4-D mask instead (``model.OpenVINOKV``): a decoder with a tree drafter asks for such caches
(``new_kv(trees=True)``).
"""

from __future__ import annotations

import numpy as np

BLOCK_INPUTS = ("key_cache.", "value_cache.")


def paged_model(core, xml_path, layers: tuple[int, ...] = ()):
    """The exported ``verispec_model.xml`` with paged attention, computing logits only at ``logit_rows``, and
    the hidden states of ``layers`` only (``hidden_states`` [tokens, 1, len(layers), hidden], in that order; none
    without layers: stacking every layer's state costs a visible share of a one-token step).

    The transformation flattens the batch into one dimension of tokens ([tokens, 1, hidden]), so the export's row
    gather (on the sequence axis) is rebuilt on the token axis in front of the lm_head."""
    from openvino import opset13 as ops
    from openvino._offline_transformations import paged_attention_transformation

    model = core.read_model(str(xml_path))
    paged_attention_transformation(model)
    rows = next(p for p in model.get_parameters() if "logit_rows" in p.output(0).get_names())
    logits = next(r for r in model.get_results() if "logits" in r.output(0).get_names())
    lm_head = logits.input_value(0).get_node()
    while lm_head.get_type_name() != "MatMul":
        lm_head = lm_head.input_value(0).get_node()
    source = lm_head.input_value(0)
    while source.get_node().get_type_name() in ("Reshape", "Transpose", "Gather", "Convert", "Squeeze",
                                                "Unsqueeze"):
        source = source.get_node().input_value(0)
    if source.get_partial_shape().rank.get_length() != 3:
        raise RuntimeError(f"unexpected graph in front of the lm_head: {source.get_partial_shape()}")
    picked = ops.gather(source, rows.output(0), np.int64(0))
    lm_head.input(0).replace_source_output(picked.output(0))
    for result in list(model.get_results()):
        if "hidden_states" in result.output(0).get_names():
            if not layers:
                model.remove_result(result)
                continue
            stacked = result.input_value(0).get_node()  # the export's torch.stack: a Concat of every layer
            if stacked.get_type_name() != "Concat":
                raise RuntimeError(f"unexpected graph in front of hidden_states: {stacked.get_type_name()}")
            count = stacked.get_input_size()
            picked_layers = ops.concat([stacked.input_value(i % count) for i in layers], stacked.get_attributes()["axis"])
            result.input(0).replace_source_output(picked_layers.output(0))
    model.validate_nodes_and_infer_types()
    return model


def static_shapes(model, width: int):
    """``model`` (a paged graph) reshaped for one sequence of ``width`` tokens, logits at each. The CPU plugin
    re-plans a dynamic graph's kernels whenever a pass's shapes differ from the last pass's (a large share of a
    small model's pass); a static graph never does, and its passes are cheaper even at one width
    (docs/openvino.md)."""
    one = {"past_lens": [1], "subsequence_begins": [2], "block_indices_begins": [2]}
    model.reshape({name: one.get(name, [width]) for name in STATIC_INPUTS})
    return model


# the inputs a static graph fixes: per token (input_ids, position_ids, logit_rows) or per sequence (one)
STATIC_INPUTS = ("input_ids", "position_ids", "logit_rows", "past_lens", "subsequence_begins", "block_indices_begins")


class BoundInputs:
    """A static graph's infer request with its inputs bound once to arrays of their own: a pass writes its values into
    them and runs the request, instead of handing OpenVINO eight arrays and taking back a dict of outputs each time
    (that Python dispatch is a few percent of a small model's pass, docs/openvino.md). An input whose shape
    changes (``block_indices`` grows by one every block of positions) gets a new array."""

    def __init__(self, ov, request) -> None:
        self.ov, self.request = ov, request
        self.arrays: dict[str, np.ndarray] = {}

    def run(self, inputs: dict[str, np.ndarray]) -> None:
        for name, value in inputs.items():
            array = self.arrays.get(name)
            if array is None or array.shape != value.shape or array.dtype != value.dtype:
                array = self.arrays[name] = np.array(value)
                self.request.set_tensor(name, self.ov.Tensor(array, shared_memory=True))
            else:
                array[...] = value
        self.request.start_async()
        self.request.wait()

    def output(self, name: str) -> np.ndarray:
        """The output ``name`` of the last pass: the request's own memory, valid until the next pass."""
        return self.request.get_tensor(name).data


class BlockPool:
    """The cache tensors of a compiled paged model: ``blocks`` blocks of ``size`` positions in every layer's key and
    value tensor, handed out to sequences; doubled (one copy) when they run out. Every infer request ``attach``ed
    (the graph with hidden states and the one without) reads and writes the same tensors."""

    def __init__(self, ov, compiled, blocks: int = 64) -> None:
        self.ov = ov
        self.requests = []
        self.ports = [p for p in compiled.inputs if p.get_any_name().startswith(BLOCK_INPUTS)]
        dims = [d.get_length() for d in list(self.ports[0].get_partial_shape())[1:]]
        self.size = dims[1]  # [blocks, kv heads, block size, head dim (+ scales for u8)]
        self.tensors: dict[str, object] = {}
        self.free: list[int] = []
        self.blocks = 0
        self._grow(blocks)

    def _grow(self, blocks: int) -> None:
        for port in self.ports:
            name = port.get_any_name()
            shape = [blocks] + [d.get_length() for d in list(port.get_partial_shape())[1:]]
            tensor = self.ov.Tensor(port.get_element_type(), shape)
            if name in self.tensors:
                tensor.data[:self.blocks] = self.tensors[name].data
            self.tensors[name] = tensor
            for request in self.requests:
                request.set_tensor(name, tensor)
        self.free.extend(range(blocks - 1, self.blocks - 1, -1))
        self.blocks = blocks

    def attach(self, request):
        """Let ``request`` (of a paged graph with the same cache inputs) run on these blocks."""
        for name, tensor in self.tensors.items():
            request.set_tensor(name, tensor)
        self.requests.append(request)
        return request

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            self._grow(max(2 * self.blocks, self.blocks + n))
        taken = self.free[-n:] if n else []
        del self.free[len(self.free) - n:]
        return taken[::-1]

    def give(self, ids) -> None:
        self.free.extend(ids)

    def copy(self, source: list[int], target: list[int]) -> None:
        for tensor in self.tensors.values():
            data = tensor.data
            data[target] = data[source]


class PagedKV:
    """One sequence's cache in a ``BlockPool``: its blocks and how many positions they hold."""
    keeps_positions = False  # no keep(): a tree step is fed again (KVCache)

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def reserve(self, n: int) -> None:
        """Blocks for ``n`` more positions."""
        need = -(-(self.length + n) // self.pool.size) - len(self.blocks)
        if need > 0:
            self.blocks.extend(self.pool.take(need))

    def truncate(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot keep {length} positions of a cache holding {self.length}")
        self.length = length
        keep = -(-length // self.pool.size)
        if keep < len(self.blocks):
            self.pool.give(self.blocks[keep:])
            del self.blocks[keep:]

    def close(self) -> None:
        self.truncate(0)

    def __del__(self) -> None:  # a cache dropped without close() gives its blocks back all the same
        try:
            self.truncate(0)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def pass_inputs(items, last_only: bool, min_width: int = 1, every_row: bool = False
                ) -> tuple[dict, list[np.ndarray], list[int], list[slice]]:
    """The paged graph's inputs for one pass over ``items`` ([(PagedKV, tokens)]), each item's rows of the logits
    output, each item's offset in the pass's tokens and which of its rows it asked for. A padded item's logits are
    computed at all its fed rows (every item's with ``every_row``: a static graph's shapes): a pass's shapes then
    depend on its width alone, and OpenVINO re-plans its kernels (a large share of a small pass) only when a shape changes. An
    item of fewer than ``min_width`` tokens is padded with copies of its last token (written past the cache's
    length, so never read: see ``OpenVINOModel.min_width``); reserves the blocks every item needs."""
    ids, positions, past, begins, blocks, block_begins, rows, offsets, picks = [], [], [], [0], [], [0], [], [], []
    longest = 0
    for kv, tokens in items:
        n = len(tokens)
        fed = list(tokens) + [tokens[-1]] * (min_width - n) if n < min_width else tokens
        kv.reserve(len(fed))
        done = len(ids)
        offsets.append(done)
        ids.extend(fed)
        positions.append(np.arange(kv.length, kv.length + len(fed), dtype=np.int64))
        past.append(kv.length)
        begins.append(len(ids))
        used = -(-(kv.length + len(fed)) // kv.pool.size)
        blocks.extend(kv.blocks[:used])
        block_begins.append(block_begins[-1] + used)
        if len(fed) > n or every_row:  # padded: logits at every fed row, so the pass's shapes depend on its width alone
            rows.append(np.arange(done, done + len(fed), dtype=np.int64))
            picks.append(slice(n - 1, n) if last_only else slice(0, n))
        else:
            rows.append(np.array([done + n - 1], dtype=np.int64) if last_only
                        else np.arange(done, done + n, dtype=np.int64))
            picks.append(slice(0, len(rows[-1])))
        longest = max(longest, kv.length + len(fed))
    inputs = {
        "input_ids": np.asarray(ids, dtype=np.int64), "position_ids": np.concatenate(positions),
        "past_lens": np.asarray(past, dtype=np.int32), "subsequence_begins": np.asarray(begins, dtype=np.int32),
        "block_indices": np.asarray(blocks, dtype=np.int32),
        "block_indices_begins": np.asarray(block_begins, dtype=np.int32),
        "max_context_len": np.array(longest, dtype=np.int32), "logit_rows": np.concatenate(rows)}
    return inputs, rows, offsets, picks
