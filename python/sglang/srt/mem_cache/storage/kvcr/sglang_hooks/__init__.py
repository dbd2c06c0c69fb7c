"""Where SGLang calls in: the hook protocol, the scheduler/tree hooks, stored marks.

``linker_hooks`` is the prepare/ready/release/finish protocol a linker implements,
``integration`` the one module touching SGLang private names (it installs the
hooks and keeps each linker's ``stored_marks``). Imports ``config`` and ``fleet``.
"""
