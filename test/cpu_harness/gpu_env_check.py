"""Environment + import check for ``gpu_check.sh`` (stage ``env``).

Records, one line each and in a JSON report: the interpreter, torch (version, CUDA
build, device name and capability), the driver as ``nvidia-smi`` reports it (when
present), then imports ``sgl_kernel`` (Python-only build: the start-up hook must
have made ``common_ops`` None), ``IPython.display`` (stand-in or real), ``sglang``,
``kvcr``, ``nixl`` (which backend module it picked), this project's package
``sglang.srt.mem_cache.storage.kvcr`` and its ``sglang.srt.plugins`` entry point,
SGLang's server modules, and the modules later stages need; last, a NIXL UCX DRAM
loopback WRITE. Exits 1 when a required check fails (with ``--expect-cuda``: also
when torch sees no CUDA device), 0 otherwise.

    python test/cpu_harness/gpu_env_check.py [--expect-cuda] [--report PATH]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Modules the later stages import (pytest collection, the bench's HTTP client).
STAGE_MODULES = ("pytest", "hypothesis", "requests", "msgpack", "numpy", "triton")
# SGLang's server path, imported for an early, cheap failure instead of a
# server that dies at start-up minutes later.
SERVER_MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.managers.scheduler",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.entrypoints.http_server",
    "sglang.launch_server",
)
# Informational: present or not (SGLang may import some of them lazily).
OPTIONAL_MODULES = (
    "psutil",
    "aiohttp",
    "PIL",
    "einops",
    "uvloop",
    "sentencepiece",
    "tqdm",
    "safetensors",
    "huggingface_hub",
    "transformers",
    "tokenizers",
    "torchvision",
)


class Checks:
    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def run(self, name: str, fn: Any, required: bool = True) -> Any:
        t0 = time.perf_counter()
        try:
            value = fn()
            ok = True
            detail = value if isinstance(value, str) else json.dumps(value, default=str)
        except BaseException as exc:  # an import can raise anything, even SystemExit
            if isinstance(exc, KeyboardInterrupt):
                raise
            value = None
            ok = False
            detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            tb = traceback.format_exc(limit=6)
            print(tb, file=sys.stderr, flush=True)
        seconds = round(time.perf_counter() - t0, 2)
        verdict = "ok" if ok else ("FAIL" if required else "missing")
        print(f"[env] {verdict:7} {name}: {detail} ({seconds} s)", flush=True)
        self.results.append(
            {
                "name": name,
                "ok": ok,
                "required": required,
                "detail": detail,
                "seconds": seconds,
            }
        )
        return value

    @property
    def failed(self) -> list[str]:
        return [r["name"] for r in self.results if r["required"] and not r["ok"]]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def check_torch(expect_cuda: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["device_count"] = torch.cuda.device_count()
        info["device"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        x = torch.ones(1 << 20, device="cuda", dtype=torch.float32)  # exact sum
        if float(x.sum().item()) != float(1 << 20):
            raise RuntimeError("a CUDA reduction returned a wrong sum")
        info["cuda_sum_ok"] = True
    elif expect_cuda:
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
    return info


def check_triton_jit() -> str:
    """Compile and run a tiny Triton kernel on the GPU (needs a host C compiler too)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    x = torch.zeros(1000, device="cuda", dtype=torch.float32)
    _add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
    torch.cuda.synchronize()
    if not bool((x == 1).all().item()):
        raise RuntimeError("Triton kernel wrote wrong values")
    cc = shutil.which("cc") or shutil.which("gcc") or "no cc on PATH"
    return f"triton {triton.__version__} kernel ok (host compiler: {cc})"


def check_nvidia_smi() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi not found"
    out = subprocess.run(
        [exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    return (out.stdout or out.stderr).strip().replace("\n", " | ")


def check_sgl_kernel() -> dict[str, Any]:
    import sgl_kernel

    info = {
        "file": sgl_kernel.__file__,
        "version": getattr(sgl_kernel, "__version__", "?"),
        "common_ops": repr(getattr(sgl_kernel, "common_ops", "<absent>")),
        "hook": bool(getattr(sgl_kernel, "__sgl_kernel_cpu_hook__", False)),
    }
    from sgl_kernel.scalar_type import scalar_types  # a pure-Python name SGLang uses

    info["scalar_types_ok"] = scalar_types.uint4b8 is not None
    return info


def check_ipython() -> str:
    mod = importlib.import_module("IPython.display")
    root = sys.modules["IPython"]
    kind = "stand-in" if getattr(root, "__kvcr_standin__", False) else "real"
    assert hasattr(mod, "HTML") and hasattr(mod, "display")
    return f"{kind} {root.__file__}"


def check_sglang() -> str:
    import sglang

    return f"{_version('sglang')} {os.path.dirname(sglang.__file__)}"


def check_kvcr() -> str:
    import kvcr

    return f"{_version('kvcr')} {os.path.dirname(kvcr.__file__)}"


def check_nixl() -> str:
    import nixl

    backend = getattr(getattr(nixl, "_pkg", None), "__name__", "?")
    return (
        f"{_version('nixl')} backend={backend} ({_version(backend.replace('_', '-'))})"
    )


def check_plugin() -> dict[str, Any]:
    pkg = importlib.import_module("sglang.srt.mem_cache.storage.kvcr")
    importlib.import_module("sglang.srt.mem_cache.storage.kvcr.kvcr_direct_linker")
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    names = {ep.name: ep.value for ep in eps}
    if "kvcr" not in names:
        raise RuntimeError(f"no 'kvcr' entry point in sglang.srt.plugins ({names})")
    return {
        "package": os.path.dirname(pkg.__file__ or ""),
        "dist": _version("sglang-kvcr"),
        "entry_point": names["kvcr"],
    }


def check_package_matches_tree() -> str:
    """The installed plugin is this work tree's (a stale wheelhouse wheel is not)."""
    import hashlib

    pkg = importlib.import_module("sglang.srt.mem_cache.storage.kvcr")
    installed = Path(pkg.__file__ or "").resolve().parent
    tree = (
        HERE.parents[1] / "python" / "sglang" / "srt" / "mem_cache" / "storage" / "kvcr"
    )
    if installed == tree.resolve():
        return f"imported from the work tree {tree}"

    def digests(root: Path) -> dict[str, str]:
        return {
            str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*.py"))
        }

    mine, theirs = digests(tree), digests(installed)
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if differ:
        raise RuntimeError(
            f"installed {installed} differs from the work tree in {differ[:6]}: "
            "rebuild the wheelhouse (build_wheelhouse.sh)"
        )
    return f"{len(mine)} files identical to the work tree ({installed})"


def check_import(name: str) -> str:
    mod = importlib.import_module(name)
    return str(getattr(mod, "__version__", "") or getattr(mod, "__file__", ""))


def check_loopback() -> dict[str, Any]:
    from nixl_loopback_check import loopback_write

    result = loopback_write(1 << 20)
    if result["state"] != "DONE" or not result["equal"]:
        raise RuntimeError(f"loopback WRITE: {result}")
    result["seconds"] = round(float(result["seconds"]), 6)  # type: ignore[arg-type]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--expect-cuda", action="store_true")
    p.add_argument("--report", default="")
    p.add_argument(
        "--skip-server-imports",
        action="store_true",
        help="skip importing SGLang's server modules (about 15 s on a small CPU)",
    )
    args = p.parse_args(argv)
    c = Checks()
    c.run(
        "python",
        lambda: f"{platform.python_version()} {sys.executable} {platform.platform()}",
    )
    c.run(
        "env",
        lambda: {
            k: os.environ.get(k, "")
            for k in (
                "PYTHONPATH",
                "SGLANG_USE_CPU_ENGINE",
                "SGLANG_KVCR_PY_ONLY_SGL_KERNEL",
                "SGLANG_FORCE_FUSED_OP_BACKEND",
                "UCX_NET_DEVICES",
                "UCX_TLS",
                "CUDA_VISIBLE_DEVICES",
            )
        },
    )
    c.run("torch", lambda: check_torch(args.expect_cuda))
    c.run("nvidia-smi", check_nvidia_smi, required=False)
    if args.expect_cuda:
        c.run("triton JIT on CUDA", check_triton_jit)
    c.run("sgl_kernel", check_sgl_kernel)
    c.run("IPython.display", check_ipython)
    c.run("sglang", check_sglang)
    c.run("kvcr", check_kvcr)
    c.run("nixl", check_nixl)
    c.run("sglang.srt.mem_cache.storage.kvcr", check_plugin)
    c.run("plugin matches work tree", check_package_matches_tree)
    for name in STAGE_MODULES:
        c.run(name, lambda n=name: check_import(n))
    if not args.skip_server_imports:
        for name in SERVER_MODULES:
            c.run(name, lambda n=name: check_import(n))
    for name in OPTIONAL_MODULES:
        c.run(name, lambda n=name: check_import(n), required=False)
    c.run("nixl UCX DRAM loopback WRITE", check_loopback)
    failed = c.failed
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(
            json.dumps({"failed": failed, "checks": c.results}, indent=2) + "\n"
        )
        print(f"REPORT {args.report}", flush=True)
    print(f"[env] {'PASS' if not failed else 'FAIL ' + ', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
