"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn)."""

from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
