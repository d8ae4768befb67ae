"""How much a suffix store seeded with the target's own answers adds (docs/results-archive.md, 2026-11-26 05:00 UTC).

    python experiments/suffix_seed.py --data DATA --answers 1000 --max-tokens 200000

DATA is a ``train-eagle --data`` folder (token shards: the target's greedy answers to training prompts). The
process's shared suffix store is seeded with the answers of the first ``--answers`` of them, then the suffix drafter
(fixed k) decodes Spec-Bench first turns on the OpenVINO int4 backend; prints tokens per pass and tokens/s.
"""

import argparse
import glob
import json

from safetensors.numpy import load_file

from verispec import SpeculativeDecoder, make_drafter
from verispec.backends import load_model
from verispec.bench.prompts import PACKAGED
from verispec.drafters import suffix

from drafter_rate import decode_rate  # experiments/ is on the path when a script runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--answers", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=200_000)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()
    rows = [json.loads(line) for line in PACKAGED.open()]
    texts = [r["turns"][0] for r in rows[::8][:args.prompts]]
    target = load_model("smollm2-135m", backend="openvino", weights="int4", threads=2)
    store = suffix.shared_store()
    store.max_tokens = args.max_tokens
    added = 0
    for path in sorted(glob.glob(f"{args.data}/shard-*.safetensors")):
        shard = load_file(path)
        for i in range(len(shard["answer_start"])):
            if added == args.answers:
                break
            a, b = shard["offsets"][i], shard["offsets"][i + 1]
            sid = store.open()
            store.extend(sid, shard["tokens"][a:b][shard["answer_start"][i]:].tolist())
            store.close(sid)
            added += 1
    print(f"seeded {added} answers, {store.tokens} tokens")
    decoder = SpeculativeDecoder(target, make_drafter("suffix", target), k=args.k, k_policy="fixed")
    rate, per_step = decode_rate(decoder, texts)
    print(f"{per_step:.3f} tokens per pass, {rate:.1f} tok/s")


if __name__ == "__main__":
    main()
