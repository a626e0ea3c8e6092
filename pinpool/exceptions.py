"""Every error pinpool raises on purpose.

Each class subclasses the standard exception a caller would already catch, so
``except ValueError`` keeps working, and messages follow one pattern:
``'<parameter>' must <rule> (got <value>)``, plus what to do when there is a fix.
``pinpool`` exports the eight a caller catches; the refinements below them (a pool used from
another thread, a refused platform, an unguarded reader) are ``PoolStateError`` subclasses.
"""

from __future__ import annotations


class PinpoolError(Exception):
    """Base class of every error raised by pinpool, sampling and memcache."""


class SettingsError(PinpoolError, ValueError):
    """A settings field broke its rule."""


class SettingsTypeError(SettingsError, TypeError):
    """A settings field, or the settings object itself, has the wrong type (``debug='yes'``, ``settings='cpu'``).

    Both a ``SettingsError`` and a ``TypeError``: ``except TypeError`` written against the
    untyped errors these used to be keeps working.
    """


class SettingsWarning(UserWarning):
    """A ``PINPOOL_*`` environment variable that no part of pinpool reads (most likely a typo)."""


class CapacityError(PinpoolError, ValueError):
    """A stage needs more bytes than its slot (or owned buffer) holds."""


class StagingTypeError(PinpoolError, TypeError):
    """A value handed to ``put`` has a type or dtype pinpool cannot stage."""


class StagingValueError(PinpoolError, ValueError):
    """A value handed to ``put`` does not convert exactly to the requested dtype."""


class DeviceMismatchError(PinpoolError, ValueError):
    """A stream or tensor lives on another device than the pool's."""


class PoolStateError(PinpoolError, RuntimeError):
    """The pool was used in a state that forbids the call (closed, nested stage)."""


class ThreadOwnershipError(PoolStateError):
    """A pool was used from a thread other than the one that created it."""


class StaleLeaseError(PinpoolError, RuntimeError):
    """A staged slice was used after its slot was recycled."""


class HostSyncError(PinpoolError, RuntimeError):
    """Code inside ``no_sync()`` made (or would make) the host wait on the GPU."""


class PlatformError(PoolStateError):
    """Zero-copy staging was refused: the start-up platform check found the slab unfit for UVA reads."""


class UnguardedReaderError(PoolStateError):
    """(debug) A zero-copy stage closed under a stream that is neither its own nor a registered consumer."""
