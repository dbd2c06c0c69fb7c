"""Host and device primitives: page-locked host memory, device binding and fences.

``host_memory`` allocates (and pins on GPU hosts) the buffers KVCR DRAM and
staging live in; ``device_streams`` binds side threads to the rank's device,
creates their streams and waits on fences with a deadline. torch only; imports
nothing of this package.
"""
