"""Tests of ``observability/``: the linker's one stats snapshot, the KVCR_STATS
line printed from it and the Prometheus families fed from it. Fixtures: the shared
``pool`` / ``linker``.
"""
