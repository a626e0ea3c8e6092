"""Every error pinpool raises on purpose, each also the standard exception a caller already catches.
Messages read ``'<parameter>' must <rule> (got <value>)``, plus the fix when there is one."""


class PinpoolError(Exception):
    """Base class of every error raised by pinpool, sampling and memcache."""


class SettingsError(PinpoolError, ValueError):
    """A settings field broke its rule."""


class SettingsTypeError(SettingsError, TypeError):
    """Wrong type (``debug='yes'``): ``except TypeError`` works."""


class SettingsWarning(UserWarning):
    """A ``PINPOOL_*`` variable that nearly spells a settings variable but is none (most likely a typo)."""


class CapacityError(PinpoolError, ValueError):
    """A stage needs more bytes than its slot (or owned buffer) holds."""


class StagingTypeError(PinpoolError, TypeError):
    """A put value of a type or dtype pinpool cannot stage."""


class StagingValueError(PinpoolError, ValueError):
    """A put value that does not convert exactly to its dtype."""


class DeviceMismatchError(PinpoolError, ValueError):
    """A stream or tensor on another device than the pool's."""


class PoolStateError(PinpoolError, RuntimeError):
    """A call the pool's state forbids (closed, nested stage)."""


class ThreadOwnershipError(PoolStateError):
    """A pool used from a thread other than its creator's."""


class StaleLeaseError(PinpoolError, RuntimeError):
    """A staged slice used after its slot was recycled."""


class HostSyncError(PinpoolError, RuntimeError):
    """Code inside ``no_sync()`` made the host wait on the GPU."""


class PlatformError(PoolStateError):
    """Zero-copy refused: the platform check found the slab unfit for UVA reads."""


class UnguardedReaderError(PoolStateError):
    """(debug) A zero-copy stage closed under a stream that is neither its own nor a registered consumer."""


#: Why a stage or read-back is refused while a CUDA graph capture would take it.
CAPTURE_REFUSAL = (
    "a stream this stage would touch is capturing a CUDA graph (its 'stream', or the current "
    "stream): the stage's copy and fence would be baked into the graph at this slot's address, "
    "every replay reading or writing the slot after the ring has reused it; stage before the "
    "capture or between replays, and give the graph a DeviceBlock's views (fixed addresses)"
)

#: How to make a value fit that did not: the end of every ``CapacityError`` a put or reserve raises.
CAPACITY_FIX = "raise PoolSettings.slot_bytes (PINPOOL_SLOT_BYTES)"
