"""The OpenAI-compatible endpoint of the inference service, its sessions, and external agents.

FastAPI and uvicorn are imported only when a server starts.
"""

from unipg.sample.endpoint.agents import AgentStats, ExternalAgent, ExternalAgentLoop, load_agent
from unipg.sample.endpoint.protocol import Completions, Limits
from unipg.sample.endpoint.server import EndpointServer
from unipg.sample.endpoint.sessions import Session, Sessions, SessionTrajectory

__all__ = ["AgentStats", "Completions", "EndpointServer", "ExternalAgent", "ExternalAgentLoop", "Limits", "Session",
           "SessionTrajectory", "Sessions", "load_agent"]
