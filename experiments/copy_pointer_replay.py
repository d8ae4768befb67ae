"""A copy pointer into the prompt for code edits, replayed offline beside the suffix drafter (not kept: docs/kernels.md,
"2026-12-07 late night"). The pointer (anchor) is advanced token by token as an answer copies its source and, after a
miss, re-aligned on the nearest occurrence of the new token within a window around it (the longest match back first);
it drafts what follows it ("anchor"), or after a first miss what follows the replaced token ("anchor+skip"), and the
suffix drafter where it has nothing. Reads a `verispec bench` run's greedy baseline answers as suffix_ceiling.py does
and prints, per drafter, accepted tokens a position and the speedups of a few policies on the given cost curve.

    python experiments/copy_pointer_replay.py runs/base_code 1:50,2:55,4:66,8:95.5,16:123
"""
import sys

from suffix_ceiling import cost_curve, load_run, replay, speedup

W_BACK, W_FWD = 4, 48


class Anchor:
    def __init__(self, store, sid):
        self.store, self.sid = store, sid
        self.pos = None  # (sid, index) of the token expected next
        self.miss = 0

    def seq(self):
        return self.store.sequences[self.pos[0]]

    def step(self, context, t):
        """context already ends with t."""
        if self.pos is not None:
            seq = self.seq()
            s, i = self.pos
            if i < len(seq) and seq[i] == t and not (s == self.sid and i >= len(context) - 1):
                self.pos = (s, i + 1); self.miss = 0; return
            # realign near the anchor
            best = None
            lo, hi = max(1, i - W_BACK), min(len(seq), i + W_FWD)
            if s == self.sid:
                hi = min(hi, len(context) - 1)
            for j in range(lo, hi):
                if seq[j] == t:
                    m = 1
                    while m < 16 and j - m >= 0 and len(context) - 1 - m >= 0 and seq[j - m] == context[-1 - m]:
                        m += 1
                    key = (m, -abs(j - i))
                    if best is None or key > best[0]:
                        best = (key, j)
            if best is not None:
                self.pos = (s, best[1] + 1); self.miss = 0; return
            self.miss += 1
            if self.miss > 8:
                self.pos = None
        # no anchor: the longest suffix match of >= 2 tokens
        if self.pos is None and len(context) >= 2:
            found = self.store.index.get(tuple(context[-2:]))
            if found:
                bestm, bestpos = 0, None
                for sid, start in reversed(found):
                    seq = self.store.sequences.get(sid)
                    if seq is None or (sid == self.sid and start >= len(context)) or start >= len(seq):
                        continue
                    m = 2
                    while m < 32 and start - 1 - m >= 0 and seq[start - 1 - m] == context[-1 - m]:
                        m += 1
                    if m > bestm:
                        bestm, bestpos = m, (sid, start)
                if bestpos is not None and bestm >= 3:
                    self.pos, self.miss = bestpos, 0

    def draft(self, context, k, skip):
        if self.pos is None:
            return None
        s, i = self.pos
        seq = self.seq()
        if self.miss:
            if not skip or self.miss > 1:
                return None
            i += 1  # assume the anchor's token was replaced
        end = i + k
        if s == self.sid:
            end = min(end, len(context))
        return seq[i:end]


def anchored(mode):
    """replay's ``first``: the pointer's drafts (mode "anchor" or "anchor+skip"), none for "suffix"."""
    if mode == "suffix":
        return None

    def first(store, drafter, prompt):
        drafter._sync(prompt)
        anchor = Anchor(store, drafter._sid)

        def draft(context, p, answer):
            if p:
                anchor.step(context, answer[p - 1])
            return anchor.draft(context, 32, skip=(mode == "anchor+skip"))
        return draft
    return first


if len(sys.argv) != 3:
    sys.exit(__doc__)
run, costs = sys.argv[1], sys.argv[2]
cost = cost_curve(costs)
records, prompts, tok = load_run(run)
groups = sorted({r["group"] for r in records})
print("| drafter | policy | " + " | ".join(groups) + " | all | accepted/pos |")
for mode in ("suffix", "anchor", "anchor+skip"):
    ans = replay(records, prompts, tok, 32, anchored(mode))
    acc = sum(r["a"] for a in ans.values() for r in a["rows"]) / sum(len(a["rows"]) for a in ans.values())
    pols = {"oracle": lambda r: r["a"], "fixed-2": lambda r: 2, "fixed-4": lambda r: 4, "fixed-8": lambda r: 8}
    for name, pol in pols.items():
        print(f"| {mode} | {name} | " + " | ".join(f"{speedup(ans, pol, cost, g):.2f}x" for g in groups)
              + f" | {speedup(ans, pol, cost):.2f}x | {acc:.2f} |")
