"""Load time, peak memory and one-token pass time of a model on the blocks backend.

    python experiments/blocks_load_memory.py qwen2.5-coder-1.5b

Loads the model, prefills 256 tokens, times 20 one-token passes and prints the load time, the process's peak RSS
(``getrusage``: what the load and the passes needed at most, the interpreter and torch included) and the median pass.
Run each variant in its own process (the peak is the process's)."""

import resource
import sys
import time

from verispec.backends import blocks

ref = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
start = time.time()
model = blocks.load(ref)
took = time.time() - start
kv = model.new_kv()
model.forward(kv, list(range(100, 356)))
times = []
for i in range(20):
    start = time.perf_counter()
    model.forward(kv, [500 + i])
    times.append(time.perf_counter() - start)
times.sort()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux
print(f"{ref}: load {took:.1f} s, peak RSS {peak:.2f} GB, one-token pass median {1e3 * times[10]:.1f} ms, "
      f"embedding {type(model.model.get_input_embeddings()).__name__}")
