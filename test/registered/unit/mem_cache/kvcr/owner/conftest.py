"""Tests of ``owner/``: the KVCR owner thread (``KVCRAdapter`` over a real kvcr +
NIXL), kvcr's progress pacing, and the fault scenarios of ``make faults`` (in
process and against peer processes). Each module holds its own fixtures.
"""
