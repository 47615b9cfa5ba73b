"""The Temporal worker process: registers the run workflow and its activities."""

from worker.main import WorkerSettings, build_worker, serve

__all__ = ["WorkerSettings", "build_worker", "serve"]
