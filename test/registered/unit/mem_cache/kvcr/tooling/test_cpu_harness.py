"""Quick checks of the CPU harness: tiny model, sgl_kernel hook, torchvision stub."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_harness import tiny_model
from cpu_harness.server import PYTHONPATH_DIR, REPO, free_port, python_executable

SUBPROCESS_TIMEOUT_S = 120


def _child_env(**overrides: str | None) -> dict[str, str]:
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(PYTHONPATH_DIR) not in parts:
        parts.insert(0, str(PYTHONPATH_DIR))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _run_python(code: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python_executable(), "-c", code],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=_child_env(**env),
        cwd="/",  # not the repo: nothing importable by accident from the cwd
        check=False,
    )


def test_tiny_model_build_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "tiny", tmp_path / "b" / "tiny"
    # One build in a child with another hash seed (the BPE trainer uses hash
    # maps), one here; both run at the same time to keep the test short.
    child = subprocess.Popen(
        [python_executable(), str(Path(tiny_model.__file__)), str(b)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_child_env(PYTHONHASHSEED="12345"),
    )
    try:
        assert tiny_model.ensure_tiny_model(a) == a.absolute()
        out, _ = child.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert child.returncode == 0, out

    for name in (
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
    ):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert tiny_model.is_complete(a) and tiny_model.is_complete(b)
    # Atomic build: no temporary or stale directories left beside the result.
    assert [p.name for p in a.parent.iterdir()] == ["tiny"]

    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (2, 64)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert cfg["max_position_embeddings"] == 4096

    # Present and complete: returned as is, not rebuilt.
    before = (a / "model.safetensors").stat().st_mtime_ns
    assert tiny_model.ensure_tiny_model(a) == a.absolute()
    assert (a / "model.safetensors").stat().st_mtime_ns == before

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    text = "Hello world, the cache stores 4096 pages!"
    ids = tok.encode(text).ids
    assert 0 < len(ids) < len(text)  # the trained merges are in use
    assert max(ids) < cfg["vocab_size"]
    assert tok.decode(ids) == text


def test_tiny_model_rebuilds_incomplete_directory(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text("{}")  # a half-written left-over, no marker
    assert not tiny_model.is_complete(target)
    tiny_model.ensure_tiny_model(target)
    assert tiny_model.is_complete(target)
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"


_SGL_KERNEL_PROBE = """
import json, sys
finders = [type(f).__name__ for f in sys.meta_path]
torch_at_startup = "torch" in sys.modules
import sgl_kernel
from sgl_kernel import copy_all_layer_kv_cache_cpu
from sgl_kernel.scalar_type import scalar_types
print(json.dumps({
    "finders": finders,
    "torch_at_startup": torch_at_startup,
    "common_ops_is_none": sgl_kernel.common_ops is None,
    "hooked": getattr(sgl_kernel, "__sgl_kernel_cpu_hook__", False),
    "file": sgl_kernel.__file__,
    "copy_fn": callable(copy_all_layer_kv_cache_cpu),
    "uint4b8": str(scalar_types.uint4b8),
}))
"""


def test_sgl_kernel_hook_imports_installed_package_on_cpu() -> None:
    proc = _run_python(_SGL_KERNEL_PROBE, SGLANG_USE_CPU_ENGINE="1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["finders"][0] == "SglKernelCpuFinder"
    assert result["torch_at_startup"] is False  # start-up stays light
    assert result["common_ops_is_none"] is True
    assert result["hooked"] is True
    assert result["copy_fn"] is True
    assert result["uint4b8"] == "uint4b8"
    # The pip-installed package ran, not a copy inside the repo.
    assert "site-packages" in result["file"]
    assert not Path(result["file"]).resolve().is_relative_to(REPO / "test")


def test_sgl_kernel_hook_inactive_without_cpu_engine_flag() -> None:
    # Control: without SGLANG_USE_CPU_ENGINE the finder is not installed and the
    # installed package fails to load its native ops, as it does on any CPU box.
    proc = _run_python(
        "import sys\n"
        "names = [type(f).__name__ for f in sys.meta_path]\n"
        "assert 'SglKernelCpuFinder' not in names, names\n"
        "import sgl_kernel\n",
        SGLANG_USE_CPU_ENGINE=None,
    )
    assert proc.returncode != 0
    assert "AssertionError" not in proc.stderr
    assert "common_ops" in proc.stderr, proc.stderr[-4000:]


GPU_PYTHONPATH_DIR = PYTHONPATH_DIR.parent / "gpu_pythonpath"
CPU_ENGINE = {"SGLANG_USE_CPU_ENGINE": "1"}
PY_ONLY = {"SGLANG_KVCR_PY_ONLY_SGL_KERNEL": "1"}

_STARTUP_PROBE = """
import json, os, sys
print(json.dumps({
    "finders": [type(f).__name__ for f in sys.meta_path],
    "patches": "sglang_cpu_patches" in sys.modules,
    "harness_on_path": %r in [os.path.abspath(p) for p in sys.path if p],
    "chained": os.environ.get("KVCR_TEST_CHAINED", ""),
}))
"""


@pytest.mark.parametrize(
    ("dirs", "flags", "hook", "patches", "on_path"),
    [
        # make test, and the CPU servers it starts.
        ((PYTHONPATH_DIR,), CPU_ENGINE, True, True, True),
        ((PYTHONPATH_DIR,), {}, False, False, True),
        # SGLang reads only 1/true as the CPU engine flag; so does the hook.
        ((PYTHONPATH_DIR,), {"SGLANG_USE_CPU_ENGINE": "yes"}, False, False, True),
        # gpu_check.sh on the GPU host: the Python-only sgl_kernel, no CPU patches.
        ((GPU_PYTHONPATH_DIR, PYTHONPATH_DIR), PY_ONLY, True, False, True),
        (
            (GPU_PYTHONPATH_DIR,),
            {"SGLANG_KVCR_PY_ONLY_SGL_KERNEL": "on"},
            True,
            False,
            True,
        ),
        # The GPU directory alone, no flag: nothing installed, nothing added.
        ((GPU_PYTHONPATH_DIR,), {}, False, False, False),
        # The CPU harness first: it runs, then the GPU one, each once.
        ((PYTHONPATH_DIR, GPU_PYTHONPATH_DIR), CPU_ENGINE, True, True, True),
    ],
    ids=[
        "cpu",
        "cpu-no-flag",
        "cpu-flag-yes",
        "gpu-check",
        "gpu-alone-flag-on",
        "gpu-alone-no-flag",
        "cpu-then-gpu",
    ],
)
def test_start_up_shims_install_what_their_flags_ask_and_chain_once(
    tmp_path: Path,
    dirs: tuple[Path, ...],
    flags: dict[str, str],
    hook: bool,
    patches: bool,
    on_path: bool,
) -> None:
    """Each ``sitecustomize`` installs the sgl_kernel hook (and the CPU harness
    one its SGLang patches) only under its flags, and the next ``sitecustomize``
    on the path still runs, exactly once."""
    chained = tmp_path / "chained"
    chained.mkdir()
    (chained / "sitecustomize.py").write_text(
        "import os\n"
        'os.environ["KVCR_TEST_CHAINED"] = os.environ.get("KVCR_TEST_CHAINED", "") + "+"\n'
    )
    path = os.pathsep.join(str(d) for d in (*dirs, chained))
    env = {"SGLANG_USE_CPU_ENGINE": None, "SGLANG_KVCR_PY_ONLY_SGL_KERNEL": None}
    proc = _run_python(
        _STARTUP_PROBE % str(PYTHONPATH_DIR.resolve()),
        **{**env, **flags, "PYTHONPATH": path, "KVCR_TEST_CHAINED": None},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ("SglKernelCpuFinder" in result["finders"]) is hook, result
    if hook:
        assert result["finders"][0] == "SglKernelCpuFinder"
    assert ("SglangCpuPatchFinder" in result["finders"]) is patches, result
    assert result["patches"] is patches
    assert result["harness_on_path"] is on_path
    assert result["chained"] == "+"


def test_torchvision_stand_in_satisfies_imports() -> None:
    spec = importlib.util.find_spec("torchvision")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().is_relative_to(PYTHONPATH_DIR.resolve())

    import torchvision
    import torchvision.transforms as T
    from packaging.version import Version
    from torchvision.io import decode_image  # a name transformers imports

    assert Version(torchvision.__version__) >= Version("0.20")
    assert T.__name__ == "torchvision.transforms"
    assert sys.modules["torchvision.transforms"] is T

    # Every name, call and item is an inert placeholder naming how it was reached.
    def stand_in(path: str) -> str:
        return f"<torchvision stand-in {path}>"

    assert repr(decode_image) == stand_in("torchvision.io.decode_image")
    composed = T.Compose([T.ToTensor()])
    assert repr(composed) == stand_in("torchvision.transforms.Compose()")
    assert repr(composed(object())) == stand_in("torchvision.transforms.Compose()()")
    assert repr(composed[0]) == stand_in("torchvision.transforms.Compose()[]")
    mode = T.InterpolationMode.BICUBIC
    assert repr(mode) == stand_in("torchvision.transforms.InterpolationMode.BICUBIC")
    # Special names are not answered (copy, pickle and numpy probe for them) ...
    assert not hasattr(composed, "__array__")
    assert not hasattr(T, "__wrapped__")

    # ... and a placeholder used as a base class leaves a plain class.
    class Transform(T.Normalize):  # type: ignore[misc,name-defined]
        pass

    assert Transform.__mro__ == (Transform, object)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_free_ports_stay_clear_of_sglang_own_picks(monkeypatch) -> None:
    """No port window handed out falls in the range SGLang picks a child's port
    from (``get_free_port_below_ephemeral``, which a server starting beside ours
    may take before ours binds) or in the kernel's ephemeral range."""
    import inspect

    from sglang.srt.utils.network import get_free_port_below_ephemeral

    from cpu_harness import server

    monkeypatch.setattr(server, "_HANDED", {})
    defaults = inspect.signature(get_free_port_below_ephemeral).parameters
    low, high = defaults["low"].default, defaults["high"].default
    for _ in range(200):
        port = server.free_port()
        span = range(port, port + server.SPAN)
        assert not any(low <= p <= high for p in span), port
        assert max(span) < 32768, port
        server._HANDED.clear()  # draw from the whole range each time


def test_a_port_window_is_not_handed_out_twice(monkeypatch) -> None:
    """Ports a test picks before any server binds them (events, control, HTTP)
    never share a window: a draw overlapping one handed out is drawn again."""
    from cpu_harness import server

    class Script:
        def __init__(self, values):
            self.values = iter(values)

        def randrange(self, low, high):
            return next(self.values)

    monkeypatch.setattr(server, "_HANDED", {})
    monkeypatch.setattr(server, "_bindable", lambda host, port: True)  # scripted
    first = 15000
    overlapping = [first + d for d in range(-server.SPAN + 1, server.SPAN)]
    clear = first + server.SPAN
    monkeypatch.setattr(server, "_PORTS", Script([first, *overlapping, clear]))
    assert server.free_port() == first
    assert server.free_port() == clear


def test_server_env_appends_an_extra_pythonpath_after_the_harness(tmp_path):
    """A server's extra ``PYTHONPATH`` (the bench's null-linker server imports
    from ``test/``) comes right after the harness's own start-up directory (never
    in place of it, and ahead of inherited entries); other extra variables
    override."""
    from cpu_harness.server import server_env

    env = server_env(tmp_path, {"PYTHONPATH": "/extra/dir", "KVCR_PROBE": "1"})
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[:2] == [str(PYTHONPATH_DIR), "/extra/dir"], parts
    assert env["KVCR_PROBE"] == "1"


_DUAL_GEMM_PROBE = """
import json
from sglang.srt.layers.dual_gemm import DualGemm
print(json.dumps({"mode": repr(DualGemm._select_mode(None, None, 1024)),
                  "name": DualGemm._select_mode.__name__}))
"""


@pytest.mark.parametrize(("flags", "hooked"), [(PY_ONLY, True), ({}, False)])
def test_gpu_shim_keeps_the_cute_dsl_dual_gemm_out_without_cutlass(
    flags: dict[str, str], hooked: bool
) -> None:
    """On the GPU host (no ``cutlass``) the GPU shim makes SGLang's DualGemm pick
    no fused mode, so a Qwen MLP builds (its import of the CuTe DSL kernel would
    fail); without the Python-only flag SGLang's own method stays."""
    assert importlib.util.find_spec("cutlass") is None  # as on the GPU host
    env = {"SGLANG_USE_CPU_ENGINE": None, "SGLANG_KVCR_PY_ONLY_SGL_KERNEL": None}
    proc = _run_python(
        _DUAL_GEMM_PROBE,
        **{**env, **flags, "PYTHONPATH": str(GPU_PYTHONPATH_DIR)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if hooked:
        assert result == {"mode": "None", "name": "_no_fused_mode"}, result
    else:
        assert result["name"] == "_select_mode", result


def test_a_server_whose_http_port_is_taken_fails_at_once(tmp_path) -> None:
    """uvicorn logs a taken HTTP port and SGLang's processes stay up; waiting
    for readiness fails on that line, naming the port, not at the deadline."""
    import subprocess
    import time

    from cpu_harness import server

    log = tmp_path / "server.log"
    log.write_text(
        "[2026-12-07 09:53:31] ERROR:    [Errno 98] error while attempting to bind "
        "on address ('127.0.0.1', 24815): address already in use\n"
        "[2026-12-07 09:53:31] still starting\n"
    )
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    handle = server.ServerHandle(
        process=process,
        port=server.free_port(),
        host="127.0.0.1",
        log_path=log,
        command=["sleep", "60"],
        started_at=time.monotonic(),
    )
    try:
        started = time.monotonic()
        with pytest.raises(server.ServerStartError, match="could not bind its HTTP"):
            handle.wait_ready(timeout=60)
        assert time.monotonic() - started < 10
    finally:
        process.kill()
        process.wait(5)
