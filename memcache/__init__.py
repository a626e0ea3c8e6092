"""memcache: request rows, KV-slot allocation, and ``write_cache_indices`` staged through pinpool.

The installed module name ``memcache`` clashes with python-memcached's; the two cannot
share an environment.
"""

from memcache.allocate import allocate_extend
from memcache.exceptions import AllocationError, CacheIndexError
from memcache.host_kv_allocator import HostKVAllocator
from memcache.kv_allocator import TokenToKVPoolAllocator
from memcache.req_to_token import ReqToTokenPool
from memcache.write_cache import write_cache_indices
from memcache.write_kernel import launch_write_req_to_token, write_req_to_token_reference

__all__ = [
    "AllocationError",
    "CacheIndexError",
    "HostKVAllocator",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "allocate_extend",
    "launch_write_req_to_token",
    "write_cache_indices",
    "write_req_to_token_reference",
]
