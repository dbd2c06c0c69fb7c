"""Tests of the package's top-level modules: ``KVCRDirectLinker`` over a real kvcr +
NIXL and CPU pool, the builder, and the package's house rules (layers import down,
no circles). Fixtures: the shared ``pool`` / ``linker``.
"""
