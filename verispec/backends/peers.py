"""What bench's peers (llama-server, llama-cpp-python's own generation, OpenVINO GenAI) take from the backends: the
same model files, export folders, threads and build settings verispec's own targets run, so that a comparison is on
one model and one machine. The peers live in ``verispec.bench``; nothing here runs a model."""

from __future__ import annotations

from .llamacpp import NO_AMX_CMAKE_ARGS, default_threads, ensure_runs, import_llama_cpp, no_extra_buffers
from .openvino.export import WEIGHTS as OPENVINO_WEIGHTS, export_dir, import_openvino, inference_precision

__all__ = ["NO_AMX_CMAKE_ARGS", "OPENVINO_WEIGHTS", "default_threads", "ensure_runs", "export_dir", "import_llama_cpp",
           "import_openvino", "inference_precision", "no_extra_buffers"]
