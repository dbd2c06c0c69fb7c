"""Settings and refusals: the linker config, its value checks, every startup refusal.

``linker_config`` is the frozen ``KVCRLinkerConfig`` (unknown keys rejected),
``config_rules`` its ranges and cross-field rules, ``value_checks`` the field
checks they use, ``startup_checks`` every refusal a
start can make from the flags alone, ``one_line_errors`` how a refusal reaches the
operator as one line, ``errors`` the typed errors at the boundary. Stdlib only;
imports nothing else of this package.
"""
