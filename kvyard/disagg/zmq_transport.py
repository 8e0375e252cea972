"""The ZeroMQ implementation of `transport.py`'s protocols (source and fetcher live in their own modules)."""

from kvyard.disagg.zmq_fetcher import KVFetcher
from kvyard.disagg.zmq_source import KVSource, KVSourceStats

__all__ = ["KVFetcher", "KVSource", "KVSourceStats"]
