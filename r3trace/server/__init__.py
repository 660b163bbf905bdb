"""The HTTP server: SGLang's /generate and the OpenAI endpoints with routed-expert capture."""

from .app import create_app
from .config import ServerConfig, ServerConfigError

__all__ = ["ServerConfig", "ServerConfigError", "create_app"]
