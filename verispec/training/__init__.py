"""Training draft heads (EAGLE, Medusa) on what the target says: self-distillation data (``data``: the target's own
answers to prompts, with cached hidden states or token-only), text corpora teacher-forced through it (``corpus``),
the one training loop both head families run (``loop``: their loss, validation and saving come as an
``Objective``), and what a long run keeps between stops (``checkpoints``: checkpoints, the schedule over steps or minutes,
Ctrl-C). The heads themselves and their own objectives live in ``verispec.eagle`` and ``verispec.medusa``."""
