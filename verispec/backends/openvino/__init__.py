"""OpenVINO: models exported once to OpenVINO IR (``export``), for OpenVINO GenAI's pipelines as bench peers
(``verispec.bench.openvino_peers``). pip install "verispec[openvino]"."""
