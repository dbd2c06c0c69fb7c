"""Bytes between the device pool and KVCR DRAM: offload, restore, replica broadcast.

``offloader``/``offload_queue``/``offload_staging`` write pages through to KVCR,
``dram_copy`` (its jobs in ``copy_jobs``, its device path in ``device_gather``)
copies them into KVCR DRAM,
``restore``/``restore_copy``/``span_restore`` copy claimed pages back layer by
layer (``scratch_relay`` and ``page_rows_kernel`` for the device copies),
``replica_broadcast`` sends rank-replicated pages to the attention group, and
``device_pages`` reads a transfer's page indices. Imports every layer below it
(never the linker or the plugin).
"""
