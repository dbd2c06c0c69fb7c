"""The one module that touches SGLang private names (scheduler and tree hooks).

Filled by the integration work: it will register the preparation gate, the abort
and finish forwarding, and the EXTERNAL event hooks on SGLang 0.5.23 internals.
Keeping every private-name use here means an SGLang upgrade is reviewed in one file.
"""

from __future__ import annotations


def register_hooks() -> None:
    """Register the scheduler/tree hooks (none yet)."""
