"""Tests of ``fleet/``: between workers. Router hints (``kv.fetch@1.0``, the
endpoint allowlist, requests that may not hint), who may pull pages (ZAP address
check, CURVE keys, listeners), KV-event hashes, and fleet correctness (no request
fails or waits for another's sake). Fixtures: the shared ``pool`` / ``linker``.
"""
