"""Tests of ``datapath/`` (and the ``device/`` helpers it drives): bytes between
the pool and KVCR DRAM. Restore copies, the GPU data path (``gpu``-marked cases run
under ``gpu_check.sh``), rank-replicated pools stored once over two gloo ranks, and
the side threads' deaths. Each module holds its own fixtures.
"""
