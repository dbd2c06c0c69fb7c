"""Settings and refusals: the linker config, its value checks, every startup refusal.

``linker_config`` is the frozen ``KVCRLinkerConfig`` (unknown keys rejected),
``value_checks`` the field checks it runs, ``startup_checks`` every refusal a
start can make from the flags alone, ``one_line_errors`` how a refusal reaches the
operator as one line, ``errors`` the typed errors at the boundary. Stdlib only;
imports nothing else of this package.
"""
