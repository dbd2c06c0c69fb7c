"""Typed errors at the plugin boundary.

Everything the KVCR direct linker raises into SGLang is one of these classes, so a
caller can tell a bad configuration (fix the flag and restart) from an unavailable
or failed KVCR (the linker stops serving external hits) from a timed-out wait.
Faults from kvcr, NIXL or torch are wrapped with ``raise ... from exc`` where they
cross into the scheduler; per-request transfer failures never raise at all, they
become cache misses.
"""

from __future__ import annotations


class KVCRLinkerError(Exception):
    """Base class of every error the KVCR direct linker raises."""


class KVCRConfigError(KVCRLinkerError, ValueError):
    """The linker configuration is invalid; raised at startup, before any KVCR exists."""


class KVCRUnavailableError(KVCRLinkerError, RuntimeError):
    """kvcr/nixl cannot be imported or started, or the SGLang hooks are not installed."""


class KVCRTimeoutError(KVCRLinkerError, TimeoutError):
    """A bounded wait on the adapter's owner thread ran past its deadline."""


class KVCRAdapterFailed(KVCRLinkerError, RuntimeError):
    """The adapter's owner thread died; the stored cause is chained as ``__cause__``."""
