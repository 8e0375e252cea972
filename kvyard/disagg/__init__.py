"""Prefill/decode disaggregation: moving a prompt's KV blocks from the worker that computed them to the
worker that decodes. See `transport.py` for the interfaces and `zmq_transport.py` for the implementation."""

from kvyard.disagg.blocks import gather_blocks, scatter_blocks
from kvyard.disagg.layout import KVLayout
from kvyard.disagg.payload import KVIntegrityError, KVPayload, KVTransferError, check_payload
from kvyard.disagg.transport import KVFetcherProtocol, KVSourceProtocol
from kvyard.disagg.zmq_transport import KVFetcher, KVSource, KVSourceStats

__all__ = [
    "KVFetcher", "KVFetcherProtocol", "KVIntegrityError", "KVLayout", "KVPayload", "KVSource",
    "KVSourceProtocol", "KVSourceStats", "KVTransferError", "check_payload", "gather_blocks", "scatter_blocks",
]
