"""The KVCR owner thread: adapter, executor, session, factory, kvcr patches, quarantine.

Every KVCR call runs on the adapter's owner thread (``kvcr_adapter`` and
``kvcr_executor``, speaking ``kvcr_commands``); ``kvcr_factory`` builds a KVCR,
``kvcr_session`` starts and re-keys its incarnations, ``quarantine`` keeps DRAM
shares through flushes, and ``kvcr_patches`` holds every kvcr private name.
Imports ``config``, ``device``, ``layout``, ``fleet``, ``observability``.
"""
