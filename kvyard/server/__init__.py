"""The OpenAI-compatible HTTP server: `kvyard serve`, or `build_app(AsyncEngine.from_config(cfg), ServerSettings())`."""

from kvyard.server.app import build_app
from kvyard.server.async_engine import AsyncEngine, EngineStats
from kvyard.server.config import ServerSettings, load_deploy_config

__all__ = ["AsyncEngine", "EngineStats", "ServerSettings", "build_app", "load_deploy_config"]
