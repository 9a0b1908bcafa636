"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn)."""

from hybridjax.server.app import ServerConfig, create_app, serve

__all__ = ["ServerConfig", "create_app", "serve"]
