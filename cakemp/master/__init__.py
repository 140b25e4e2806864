"""A Python Cake master: drives workers over Cake's protocol (tests, benchmarks, CLI)."""

from cakemp.master.client import WorkerClient

__all__ = ["WorkerClient"]
