import torch
from verispec import load_model
m = load_model("smollm2-135m")
kv = m.new_kv()
with torch.inference_mode():
    m.forward(kv, list(range(100, 400)), last_only=True)
    for _ in range(3):
        m.forward(kv, [500]); kv.truncate(300)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            m.forward(kv, [500]); kv.truncate(300)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
import time
with torch.inference_mode():
    ts=[]
    for _ in range(20):
        t=time.perf_counter(); m.forward(kv,[500]); kv.truncate(300); ts.append(time.perf_counter()-t)
print("median ms", sorted(ts)[10]*1000)
