"""Tests of ``requests/``: per-request bookkeeping driven by plain command results
(no NIXL): preparations and their claims, the offload FIFO, the residency mirror.
"""
