"""Tests of ``layout/``: what a page is. Real SGLang pools of every served family
(MHA, MLA, FULL+SWA, DSA, Mamba, DeepSeek V4, sidecar and MTP drafts) described as
KVCR objects and round-tripped byte-exact, the compatibility digest (model
identity, weights, weight updates), and rank placement. Fixtures: the shared
``pool`` / ``linker`` / ``plugin_hooks`` (the SWA module overrides ``pool`` and
``linker_options``) and each module's own stack.
"""
