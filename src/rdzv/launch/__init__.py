"""The elastic launcher behind ``rdzv run``: agent, worker supervision, options."""

from rdzv.launch.agent import ElasticAgent
from rdzv.launch.config import AgentConfig, AgentResult
from rdzv.launch.exits import WorkerExit
from rdzv.launch.workers import OutputSink, WorkerGroup, WorkerSpec

__all__ = [
    "AgentConfig",
    "AgentResult",
    "ElasticAgent",
    "OutputSink",
    "WorkerExit",
    "WorkerGroup",
    "WorkerSpec",
]
