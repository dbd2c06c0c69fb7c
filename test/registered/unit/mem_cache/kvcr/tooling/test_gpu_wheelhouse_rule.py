"""The GPU wheelhouse carries only what the host lacks, the emulated host has only
what the host has, and gpu tests are collected where torch sees no CUDA device.

``wheelhouse_rule`` (used by ``build_wheelhouse.sh`` and ``gpu_check.sh``'s
install) against ``device_packages.txt``; the emulated host's pinned requirements
against the same list; ``gpu_collection`` (the gpu stages' plugin without CUDA) in
a scratch pytest run; ``emulate_host_env.sh``'s refusal of a cache in the tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cpu_harness import wheelhouse_rule as rule
from cpu_harness.server import REPO

MANUAL = REPO / "test" / "manual" / "kvcr_direct_linker"

# What the wheelhouse used to carry though the host has it (issue 26, item 6).
HOST_HAS = (
    "pytest-8.4.2-py3-none-any.whl",
    "pluggy-1.7.0-py3-none-any.whl",
    "hypothesis-6.140.0-py3-none-any.whl",
    "requests-2.34.2-py3-none-any.whl",
    "psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.whl",
    "prometheus_client-0.26.0-py3-none-any.whl",
    "Typing_Extensions-4.16.0-py3-none-any.whl",
    "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl",
    "nvidia_nccl_cu13-2.28.9-py3-none-manylinux_2_18_x86_64.whl",
)
HOST_LACKS = (
    "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl",
    "sglang_kvcr-0.1.0-py3-none-any.whl",
    "kvcr-0.1.1-py3-none-any.whl",
    "nixl_cu13-1.5.0-cp312-cp312-manylinux_2_28_x86_64.whl",
    "pydantic-2.14.4-py3-none-any.whl",
    "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.whl",
)


def test_the_host_list_names_what_the_device_notes_give() -> None:
    host = rule.device_packages()
    assert len(host) > 150
    for name, version in {
        "torch": "2.11.0",
        "triton": "3.6.0",
        "transformers": "5.17.0",
        "numpy": "2.5.2",
        "pytest": "",
        "prometheus-client": "",
        "msgpack": "",
    }.items():
        assert host.get(name) == version, name
    for absent in ("pyzmq", "ipython", "pydantic", "sglang", "kvcr", "nixl"):
        assert absent not in host, absent


def test_only_wheels_of_packages_the_host_lacks_are_carried(tmp_path: Path) -> None:
    host = rule.device_packages()
    for name in HOST_HAS + HOST_LACKS:
        (tmp_path / name).write_bytes(b"x" * 1024)
    carried, left = rule.split(sorted(tmp_path.glob("*.whl")), host)
    assert sorted(p.name for p in carried) == sorted(HOST_LACKS)
    assert sorted(p.name for p in left) == sorted(HOST_HAS)
    behind = tmp_path.parent / "behind"
    kept = rule.prune(tmp_path, behind, host)
    assert sorted(p.name for p in kept) == sorted(HOST_LACKS)
    assert sorted(p.name for p in behind.iterdir()) == sorted(HOST_HAS)
    listing = rule.listing(kept)
    assert listing.splitlines()[-1].strip() == f"0.01 MiB  total, {len(kept)} wheels"
    assert rule.main(["check", str(tmp_path)]) == 0
    (tmp_path / HOST_HAS[0]).write_bytes(b"")
    assert rule.main(["check", str(tmp_path)]) == 1


def test_the_emulated_host_installs_only_host_packages_at_host_versions() -> None:
    host = rule.device_packages()
    reqs = {}
    for line in (MANUAL / "emulated_host_requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            reqs[rule.normalize(name)] = version
    assert all(version for version in reqs.values()), "every package pinned"
    assert sorted(set(reqs) - set(host)) == []
    pinned_elsewhere = {
        n: (v, host[n]) for n, v in reqs.items() if host[n] and host[n] != v
    }
    assert pinned_elsewhere == {}
    for needed in ("torch", "pytest", "pytest-xdist", "transformers", "requests"):
        assert needed in reqs, needed


def _scratch_suite(root: Path, with_gpu_test: bool) -> None:
    """A suite whose conftest deselects gpu tests as the project's does without
    CUDA (the plugin sees the same ``pytest_deselected`` call)."""
    (root / "conftest.py").write_text(
        "def pytest_collection_modifyitems(config, items):\n"
        "    gpu = [i for i in items if i.get_closest_marker('gpu')]\n"
        "    config.hook.pytest_deselected(items=gpu)\n"
        "    items[:] = [i for i in items if i not in gpu]\n"
    )
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: cuda\n")
    body = "import pytest\n\ndef test_cpu():\n    pass\n"
    if with_gpu_test:
        body += "\n@pytest.mark.gpu\ndef test_on_gpu():\n    pass\n"
    (root / "test_scratch.py").write_text(body)


def _collect(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "test")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q"]
        + ["-p", "no:cacheprovider", "-p", "cpu_harness.gpu_collection", str(root)],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=120,
        check=False,
    )


def test_gpu_collection_passes_only_when_gpu_tests_were_found(tmp_path: Path) -> None:
    """Without CUDA ``pytest -m gpu`` exits 5; with the plugin, 0 when gpu tests
    were collected (and deselected), still 5 when there were none."""
    found, none = tmp_path / "found", tmp_path / "none"
    found.mkdir()
    none.mkdir()
    _scratch_suite(found, with_gpu_test=True)
    _scratch_suite(none, with_gpu_test=False)
    proc = _collect(found)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu-tests: collected 1 gpu tests in 1 modules" in proc.stdout
    proc = _collect(none)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "gpu-tests: collected 0 gpu tests" in proc.stdout


def test_the_emulated_host_is_cached_outside_the_repository() -> None:
    proc = subprocess.run(
        ["bash", str(MANUAL / "emulate_host_env.sh"), str(REPO / ".cache" / "emu")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "inside the repository" in proc.stderr
    assert not (REPO / ".cache" / "emu" / "host-py312").exists()
