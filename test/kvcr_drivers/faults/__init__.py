"""Fault injection, soak, hostile-input fuzzing and TP=2 for the KVCR direct linker.

Everything runs on the real kvcr 0.1.1 + NIXL over CPU tensors on loopback;
nothing is mocked except one injected device-copy fault.

``common``         the ``Scenario`` record, the ``Harness`` that checks what a
                   scenario leaves behind (claims, threads, RSS), shared waits
``local``          in-process scenarios (stale hint, preparation deadline, flush in
                   flight, capacity, backpressure, allowlist)
``copy_fault``     a restore copy that fails on one layer (real cache + wrapper)
``peers``          peer linkers in spawned child processes; the unreachable peer
``peer_scenarios`` frozen / killed / restarted peer, flush with a quarantined op
``suite``          the fast scenarios in ``make test``'s order
``soak``, ``tp2``, ``fuzz``: the server-based and pytest-based parts
``pytest_parts``   opt-in pytest modules run as parts: ``multihost`` (linker servers
                   in network namespaces, root only), ``injection`` (faults
                   injected into a running linker server), ``validate`` (the
                   validation driver's scenario) and ``digest`` (three servers:
                   hinted restores only between workers with equal KV)
"""
