"""The logic behind ``test/manual/kvcr_direct_linker/*.py``, as importable modules.

The manual scripts are command lines (argparse + main) over these; registered
tests import them directly (``test/`` is on ``sys.path`` through
``test/registered/conftest.py``).

``faults``   fault scenarios, peer processes, soak, fuzz and TP=2 (``make faults``)
``bench``    the CPU microbench sections (``make bench``), the serving benchmark
             and the decode inter-token latency workload
``validate`` the end-to-end checks on real servers (``make demo``)
"""
