"""Process mode (`dstl.dfs.upload.mode = process`): one upload service per host and base path.

Writers hand sealed change sets over shared memory to the service, which batches every client's
tasks, applies back-pressure over all of them, retries, uploads in a pool of processes and keeps the
reference counts in a journaled registry process. See docs/service.md.
"""
from __future__ import annotations

from dstl.changelog.upload.service.client import (ProcessUploadScheduler, ServiceConnection, ServiceRegistryProxy,
                                        open_service_client)

__all__ = ["open_service_client", "ProcessUploadScheduler", "ServiceRegistryProxy", "ServiceConnection"]
