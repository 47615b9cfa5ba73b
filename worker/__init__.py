"""The Temporal worker process: registers the run workflow and its activities."""

from worker.main import build_worker, serve

__all__ = ["build_worker", "serve"]
