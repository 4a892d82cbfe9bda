"""KV-page transfer between workers: the connector interface, its NIXL and TCP backends, block descriptors.

`make_connector(settings, agent_name)` picks the backend from `settings.transfer_backend` ('auto': NIXL
when it imports and its agent starts, TCP otherwise).
"""

from __future__ import annotations

import logging

from dynserve.config import Settings
from dynserve.errors import KVTransferError
from dynserve.kv_transfer.connector import KVConnector, ReadResult, layout_of
from dynserve.kv_transfer.descriptors import BlockRun, KVLayout, Notification, coalesce_block_runs

__all__ = [
    "BlockRun",
    "KVConnector",
    "KVLayout",
    "Notification",
    "ReadResult",
    "coalesce_block_runs",
    "layout_of",
    "make_connector",
]

logger = logging.getLogger(__name__)


def make_connector(settings: Settings, agent_name: str) -> KVConnector:
    """A connector of the configured backend. KVTransferError when 'nixl' is asked for and cannot start."""
    from dynserve.kv_transfer.nixl_backend import NixlConnector, nixl_available
    from dynserve.kv_transfer.tcp_backend import TcpConnector

    backend = settings.transfer_backend
    if backend == "tcp" or (backend == "auto" and not nixl_available()):
        return TcpConnector(agent_name, settings)
    try:
        return NixlConnector(agent_name, settings)
    except KVTransferError:
        if backend == "nixl":
            raise
        logger.warning("NIXL cannot start here; KV pages move over TCP", exc_info=True)
        return TcpConnector(agent_name, settings)
