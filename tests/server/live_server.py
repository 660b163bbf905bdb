"""The server tests' live server is the product's BackgroundServer (r3trace/server/background.py)."""

from r3trace.server.background import BackgroundServer as LiveServer

__all__ = ["LiveServer"]
