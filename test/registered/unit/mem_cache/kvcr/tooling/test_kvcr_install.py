"""The install commands the docs give work as written.

A scratch virtual environment stands in for a user's: it holds this project's
SGLang 0.5.23, torch and the rest (symlinked from ``.venv``, so nothing is
downloaded or copied) but not this package. The commands of the docs' "Install"
block are run in a fresh copy of the checkout (tracked files only); afterwards
``python -m sglang.launch_server --help`` lists ``kvcr`` among the linker
backends, the plugin module comes from the scratch environment's own
site-packages, and torch and sglang are the ones that were there before. Before
the install the scratch environment has no ``kvcr`` plugin, so the check can
fail. About a minute (venv, the build, one ``--help``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.install]

REPO = Path(__file__).resolve().parents[6]
DOCS = REPO / "docs" / "kvcr_direct_linker.md"
HARNESS_PYTHONPATH = REPO / "test" / "cpu_harness" / "pythonpath"
# Path components that must be real directories in the scratch site-packages, so
# the install writes sglang/srt/mem_cache/storage/kvcr there, not through a link
# into .venv.
OWN_DIRS = (
    "sglang",
    "sglang/srt",
    "sglang/srt/mem_cache",
    "sglang/srt/mem_cache/storage",
)
CHOICES = "{mooncake,mori,dynamic,kvcr}"


def documented_commands() -> list[str]:
    """The pip lines of the docs' Install block (comments dropped)."""
    section = DOCS.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith("pip install")]


def link_site_packages(src: Path, dst: Path) -> None:
    """Every entry of ``src`` linked into ``dst``, except this package's own
    (its dist-info and editable finder) and what ``dst`` already has."""
    skip = re.compile(r"(?i)^(__editable__.*sglang_kvcr.*|sglang_kvcr-.*\.dist-info)$")
    for rel in ("", *OWN_DIRS):
        (dst / rel).mkdir(exist_ok=True)
        for entry in (src / rel).iterdir():
            target = dst / rel / entry.name
            name = f"{rel}/{entry.name}".lstrip("/")
            if skip.match(entry.name) or target.exists() or name in OWN_DIRS:
                continue
            target.symlink_to(entry)


def fresh_checkout(dst: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "-z", "pyproject.toml", "README.md", "python"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in filter(None, files):
        rel = raw.decode()
        if not (REPO / rel).exists():  # deleted in the work tree, not committed
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dst / rel)
    return dst


def test_documented_install_registers_the_plugin(tmp_path):
    commands = documented_commands()
    assert len(commands) == 2, commands
    assert commands[0] == "pip install --no-deps ."
    venv = tmp_path / "venv"
    subprocess.run(
        [sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=120
    )
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    link_site_packages(Path(sysconfig.get_paths()["purelib"]), site)
    env = {
        **os.environ,
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "VIRTUAL_ENV": str(venv),
        "PYTHONPATH": str(HARNESS_PYTHONPATH),  # torchvision stand-in (CPU only)
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    probe = (
        "import importlib.metadata as m, torch, sglang;"
        "print([e.value for e in m.entry_points(group='sglang.srt.plugins')]);"
        "print(torch.__version__, sglang.__version__)"
    )

    def run(cmd: str, cwd: Path, timeout: float = 300) -> str:
        done = subprocess.run(
            cmd,
            shell=True,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, (
            f"{cmd}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
        return done.stdout

    before = run(f"python -c {shlex.quote(probe)}", tmp_path).splitlines()
    assert "plugin:register" not in before[0], before  # nothing registers kvcr yet
    checkout = fresh_checkout(tmp_path / "sglang-kvcr")
    for cmd in commands:
        run(cmd, checkout)
    after = run(f"python -c {shlex.quote(probe)}", tmp_path).splitlines()
    assert "sglang.srt.mem_cache.storage.kvcr.plugin:register" in after[0], after
    assert after[1] == before[1], "the install changed torch or sglang"
    where = run(
        "python -c 'import sglang.srt.mem_cache.storage.kvcr.plugin as p;"
        " print(p.__file__)'",
        tmp_path,
    ).strip()
    assert Path(where).is_relative_to(site), where  # the installed copy, not the repo
    help_text = run("python -m sglang.launch_server --help", tmp_path, timeout=300)
    assert CHOICES in help_text
