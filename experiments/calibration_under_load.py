"""The controller's cost curve when the first request's calibration runs under a load spike: two processes burn
both cores for the first 6 s while the EAGLE chain answers five prompts (an empty measurements store, float32
target); prints each answer's calibration time, tokens per step and longest draft, then the curve.

    python experiments/calibration_under_load.py
"""
import multiprocessing as mp, os, sys, tempfile, time
os.environ["VERISPEC_COST_CACHE"] = tempfile.mkdtemp()

def burn(seconds):
    end = time.time() + seconds
    while time.time() < end:
        pass

if __name__ == "__main__":
    from verispec import load_model, SpeculativeDecoder, EagleDrafter
    t = load_model("smollm2-135m", dtype="float32")
    ps = ["Explain how a rainbow forms.", "Write a short story about a lost dog.", "What are the benefits of exercise?",
          "Describe the water cycle.", "List three facts about Mars and explain each."]
    ids = [t.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"] for p in ps]
    d = SpeculativeDecoder(t, EagleDrafter(t), k=8)
    burners = [mp.Process(target=burn, args=(6,)) for _ in range(2)]
    [b.start() for b in burners]
    for i, x in enumerate(ids):
        r = d.generate(x, max_new_tokens=96)
        h = r.stats.step_drafted if hasattr(r.stats, "step_drafted") else None
        print(i, "calib s", round(r.stats.calibration_seconds, 2), "tokens/step", round(r.stats.mean_accepted_tokens, 2),
              "max drafted", max(r.stats.step_drafted) if getattr(r.stats, "step_drafted", None) else "?", flush=True)
    [b.join() for b in burners]
    print({w: round(v * 1000, 1) for w, v in d.controller.costs.measured().items()})
