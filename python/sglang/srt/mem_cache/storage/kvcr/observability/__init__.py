"""What the linker counts and exports: stats, the stats line, Prometheus.

``linker_stats`` holds the counters, the typed gauges each collaborator reports
and the one snapshot behind the ``KVCR_STATS`` line; ``linker_metrics`` publishes
it as ``sglang:kvcr_*`` series. Imports ``config`` and ``fleet`` (hint reasons).
"""
