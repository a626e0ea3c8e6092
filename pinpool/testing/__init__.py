"""Test tools for code built on pinpool: nothing in the library imports them.

- ``LaggingGpu`` (``simulated.py``): a stream-aware stand-in for a CUDA device that runs
  behind the host, so stream ordering and the slot fences can be tested on a CPU.
- ``no_sync()`` (``sync_guard.py``): raise ``HostSyncError`` on any host synchronisation
  inside a block, including the ones torch's sync debug mode misses.
"""

from pinpool.testing.simulated import LaggingGpu, SimFence, SimStream
from pinpool.testing.sync_guard import check_copy, no_sync

__all__ = ["LaggingGpu", "SimFence", "SimStream", "check_copy", "no_sync"]
