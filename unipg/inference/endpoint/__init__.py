"""The OpenAI-compatible endpoint of the inference service and its sessions (the external agents that call it are
``unipg.sample.endpoint_agents``).

FastAPI and uvicorn are imported only when a server starts.
"""

from unipg.inference.endpoint.protocol import Completions, Limits
from unipg.inference.endpoint.server import EndpointServer
from unipg.inference.endpoint.sessions import Session, Sessions, SessionTrajectory

__all__ = ["Completions", "EndpointServer", "Limits", "Session", "SessionTrajectory", "Sessions"]
