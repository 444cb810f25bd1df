"""The reference backend's host context: what an engine opens first and closes last. Its
expert store is plain pageable numpy memory, which nothing copies to a device, so there is
nothing to page-lock and nothing to close."""

from __future__ import annotations

import numpy as np

from ...weights.store import numpy_alloc


class NumpyContext:
    """The reference backend needs no device: its store is plain pageable numpy memory."""

    host_alloc = staticmethod(numpy_alloc)

    @staticmethod
    def host_pin(host: np.ndarray) -> None:
        """Nothing to lock: the reference backend copies nothing to a device."""

    def __init__(self, devices: object = None, store_memory: object = None) -> None:
        """devices, store_memory: the split's device list and the CUDA store's page-locking,
        which plain numpy memory does not depend on."""

    def close(self) -> None:
        pass
