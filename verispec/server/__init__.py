"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn)."""

from .app import create_app
from .config import LocalSwitch, ServeOptions, ServerConfig, build_server_config

__all__ = ["LocalSwitch", "ServeOptions", "ServerConfig", "build_server_config", "create_app"]
