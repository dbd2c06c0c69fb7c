"""Between workers: router hints, the control-channel guard, KV event hashes.

``router_hint`` parses ``kv.fetch`` hints and the endpoint allowlist,
``control_auth`` guards the KVCR control channel (allowlist, CURVE), and
``event_hashes`` maps SGLang page hashes to the routers' event hashes. Imports
``config`` and ``layout``.
"""
