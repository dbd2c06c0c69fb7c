"""Benchmarks of the KVCR direct linker (``make bench``; GPU mode by flag).

``metrics``       targets, the metric record, distribution and machine-load helpers
``pools``         a pool of a given geometry, its linker, transfers, page rows
``copy_prepare``  restore vs torch copy_, offload vs NIXL loopback, preparation
``transfer``      restore / staged offload vs pinned host<->device copies
``hint_hooks``    hinted preparation from a peer; scheduler hook overhead
``serving_micro`` zero-hit TTFT and decode ITL on CPU servers, side by side
``serving_replay`` evicted-prompt replay from KVCR vs device hit / recompute;
                  the write-through rate and refusals of that traffic, and
                  its cold prefills back to back against after a pause
``serving``       streaming TTFT, pause/resume and report helpers of the servers
``serving_bench`` the serving benchmark (none / hicache / kvcr)
``decode_itl``    the foreground decode inter-token latency workload
"""
