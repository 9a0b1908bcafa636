"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn)."""

__all__ = ["ServerConfig", "create_app", "serve"]


def __getattr__(name):
    # Loaded on first use: `hybridjax serve` binds its port (hybridjax.server.connections) and
    # starts reading the weights before FastAPI and the app import.
    if name in __all__:
        from hybridjax.server import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
