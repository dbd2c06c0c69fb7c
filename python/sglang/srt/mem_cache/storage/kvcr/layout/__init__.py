"""What a page is: pool layouts, keys, the model identity, where the rank sits.

``pool_layout`` (one KVCR pool's spans and policy), ``pool_group_layout`` and
``pool_checks`` (SGLang's ``DevicePoolGroup`` described, or refused naming the
flag), ``page_layout`` (every pool of a rank, its keys and digest, the capacity
plan), ``model_identity`` (what the digest covers) and ``rank_placement`` (which
rank stores what, its control port). Imports ``config`` only.
"""
