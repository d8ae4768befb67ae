"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn)."""

from .app import ServerConfig, LocalSwitch, create_app

__all__ = ["ServerConfig", "LocalSwitch", "create_app"]
