"""PyTorch on CPUs, shared by the transformers backend and the drafters' torch heads (EAGLE, Medusa): what this CPU
runs (``cpu``: its instruction sets and the kernels they reach), linear layers with weights prepacked for oneDNN
(``packing``) and the on-disk store of programs compiled ahead of time with AOTInductor (``compile_store``). No
backend of its own: nothing here loads a model."""
