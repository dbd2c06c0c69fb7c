"""KVCR direct external linker for SGLang's UnifiedRadixCache (plugin package).

Importing this package is cheap: it pulls in neither torch nor kvcr. The linker
class lives in ``kvcr_direct_linker``; ``plugin.register`` is the
``sglang.srt.plugins`` entry point that makes ``--unified-cache-external-linker-backend
kvcr`` available.
"""

__version__ = "0.1.0"
