"""Write the repetition workload (verispec/bench/data/repetition/extract.jsonl): one instruction over 40 varied
records, the kind of traffic (extraction, structured output, agent loops) where answers resemble earlier answers.

    python experiments/make_repetition_workload.py      # deterministic: the same file every time

Run it with `verispec bench --prompts verispec/bench/data/repetition/extract.jsonl --methods baseline,ngram,suffix`
(bench answers the records one after another; a suffix method drafts from its own earlier answers).
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "verispec" / "bench" / "data" / "repetition" / "extract.jsonl"
INSTRUCTION = "Extract the name, the date and the amount as JSON with the keys name, date and amount from: "
FIRST = ["Maria", "John", "Aisha", "Kenji", "Lucia", "Omar", "Elena", "David", "Priya", "Tom", "Sofia", "Ahmed",
         "Grace", "Lars", "Mei", "Carlos", "Nadia", "Peter", "Yuki", "Fatima"]
LAST = ["Lopez", "Smith", "Khan", "Tanaka", "Rossi", "Haddad", "Petrova", "Brown", "Sharma", "Mueller", "Costa",
        "Nguyen", "Okafor", "Berg", "Chen", "Garcia", "Ivanova", "Walsh", "Sato", "Bello"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
TEMPLATES = [
    "On {date}, {name} paid {amount} for the annual membership.",
    "Invoice from {name}, dated {date}: total due {amount}.",
    "{name} transferred {amount} to the savings account on {date}.",
    "Receipt: {amount} received from {name} on {date} for catering services.",
    "The refund of {amount} was issued to {name} on {date}.",
    "{name} signed the lease on {date} with a deposit of {amount}.",
    "Payment reminder: {name} owes {amount}, originally due on {date}.",
    "Donation of {amount} made by {name} on {date} to the city library.",
]


def main() -> None:
    rng = random.Random(35)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", encoding="utf-8") as fh:
        for i in range(40):
            name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
            date = f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(2019, 2026)}"
            amount = f"${rng.randint(12, 9800)}.{rng.randint(0, 99):02d}"
            record = TEMPLATES[i % len(TEMPLATES)].format(name=name, date=date, amount=amount)
            fh.write(json.dumps({"question_id": f"extract-{i + 1:02d}", "category": "extract",
                                 "turns": [INSTRUCTION + record]}) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
