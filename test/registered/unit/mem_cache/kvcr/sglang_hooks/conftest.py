"""Tests of ``sglang_hooks/``: where SGLang calls into the plugin (the scheduler,
cache and linker-wrapper hooks, stored marks), in real CPU stacks: one rank, two
gloo ranks in lockstep, and SGLang's stock Mooncake linker left untouched. Their
fixtures are the shared ones (``plugin_hooks``) and each module's own stack.
"""
