"""Where SGLang calls in: the hook protocol, the scheduler/tree hooks, stored marks.

``linker_hooks`` is the prepare/ready/release/finish protocol a linker implements,
``integration`` installs the hooks (checked by ``hook_check``) and keeps each
linker's ``stored_marks``; SGLang private names are used only there and in
``weight_updates`` (the weight manager's session). Imports ``config`` and ``fleet``.
"""
