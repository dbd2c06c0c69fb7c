"""End to end on CPU servers of two more model families with the KVCR linker: MLA
(DeepseekV2ForCausalLM, one latent pool) and FULL+SWA (BeamForCausalLM, a full-KV
pool and a sliding-window pool), each a seeded-weight tiny model
(``tiny_family_models``) served with the harness's start-up patches
(``pythonpath/sglang_cpu_patches``). Per family one server computes a long prompt,
filler prompts evict it from the device, and the replay must come from KVCR: every
page-aligned token restored as a real prefix hit, greedy output and logprobs equal
to a recompute after ``/flush_cache``, logits far from uniform (so the comparison
can fail), the family named in the log, and ``restored_bytes`` equal to the pages
restored times the pool's page bytes (FULL+SWA: every KV page, only the window's
SWA pages). Both servers boot and run their round trips in parallel (module
fixture, ``kvcr_servers.family_round_trips``, which ``make demo`` runs too). The
patches' installation and their two rewrites are checked without SGLang.
"""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from cpu_harness import kvcr_servers as kvs
from cpu_harness.server import PYTHONPATH_DIR, python_executable

PROMPT_LEN = kvs.FAMILY_PROMPT_LEN
FAMILIES = ("mla", "swa")


@pytest.fixture(scope="module")
def replays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("family-servers")
    handles = [kvs.launch_family(f, work, prompt_len=PROMPT_LEN) for f in FAMILIES]
    try:  # one family's failure leaves the other's tests theirs
        return kvs.family_round_trips(handles, prompt_len=PROMPT_LEN)
    finally:
        for h in handles:
            h.stop()


@pytest.fixture(params=FAMILIES)
def replay(request: pytest.FixtureRequest, replays: dict[str, Any]) -> Any:
    found = replays[request.param]
    if isinstance(found, Exception):
        raise found
    return found


@pytest.mark.server
@pytest.mark.kvcr
def test_replay_restores_every_aligned_token_as_a_real_hit(replay: Any) -> None:
    r, c = replay.replay, replay.control
    assert replay.aligned == (PROMPT_LEN - 1) // kvs.PAGE * kvs.PAGE
    assert r["host"] == replay.aligned, (r, replay.log[-3000:])
    # A prefix hit served from KVCR, not a device hit and not a recompute.
    assert r["cached_tokens"] == replay.aligned and r["device"] == 0
    assert replay.stats()["load_pages"] == replay.aligned // kvs.PAGE
    assert replay.stats()["load_failures"] == 0
    assert c["cached_tokens"] == c["host"] == 0  # the flushed control recomputed
    assert replay.checks()["restored_tokens"] and replay.checks()["real_hit"]


@pytest.mark.server
@pytest.mark.kvcr
def test_replay_output_and_logprobs_equal_the_recompute(replay: Any) -> None:
    r, c = replay.replay, replay.control
    assert len(r["output_ids"]) == kvs.OUTPUT_LEN
    assert r["output_ids"] == c["output_ids"]
    assert r["logprobs"] == pytest.approx(c["logprobs"], abs=1e-4)
    assert r["top"] == [pytest.approx(t, abs=1e-4) for t in c["top"]]
    # Seeded weights: the logprobs are far from uniform (-ln vocab), so a wrong
    # restore would change them.
    assert replay.logprob_gap() > 1.0, c["logprobs"]
    assert len(set(c["output_ids"])) > 1


@pytest.mark.server
@pytest.mark.kvcr
def test_server_log_names_the_family_and_its_layout(replay: Any) -> None:
    assert replay.logged_family() == kvs.FAMILY_NAMES[replay.family]
    pools = {"mla": {"kv"}, "swa": {"kv", "swa"}}[replay.family]
    assert set(replay.layout_page_bytes()) == pools
    assert replay.checks()["layout_matches_geometry"], replay.layout_page_bytes()


@pytest.mark.server
@pytest.mark.kvcr
def test_restored_bytes_are_the_restored_pages_times_page_bytes(replay: Any) -> None:
    sizes = replay.layout_page_bytes()
    pages = replay.restored_pages()
    assert pages["kv"] == replay.aligned // kvs.PAGE
    if replay.family == "swa":
        assert pages["swa"] == 4 < pages["kv"]  # window 64: the last 4 pages only
    expected = sum(n * sizes[pool] for pool, n in pages.items())
    assert expected == replay.expected_restored_bytes()
    assert replay.stats()["restored_bytes"] == expected, replay.stats()
    assert replay.checks()["restored_bytes"]


_INSTALL_PROBE = """
import json, sys
print(json.dumps({
    "finders": [type(f).__name__ for f in sys.meta_path],
    "torch": "torch" in sys.modules,
}))
"""


@pytest.mark.parametrize("cpu_engine", ["1", None])
def test_patches_install_only_for_the_cpu_engine(cpu_engine: str | None) -> None:
    env = {"PYTHONPATH": str(PYTHONPATH_DIR), "PATH": "/usr/bin:/bin"}
    if cpu_engine:
        env["SGLANG_USE_CPU_ENGINE"] = cpu_engine
    proc = subprocess.run(
        [python_executable(), "-c", _INSTALL_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd="/",
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["torch"] is False  # start-up stays light
    if cpu_engine:
        assert probe["finders"][:2] == ["SglKernelCpuFinder", "SglangCpuPatchFinder"]
    else:
        assert "SglangCpuPatchFinder" not in probe["finders"]


def test_deepseek_handler_is_mla_for_torch_native_only() -> None:
    import sglang_cpu_patches as patches

    class Registry:
        _handlers = {"triton": lambda attn, fb: "mha"}

        @classmethod
        def register(cls, name: str, fn: Any) -> None:
            cls._handlers[name] = fn

    module = SimpleNamespace(
        AttnForwardMethod=SimpleNamespace(MLA="mla"), AttentionBackendRegistry=Registry
    )
    patches.patch_deepseek_handlers(module)  # type: ignore[arg-type]
    assert set(Registry._handlers) == {"triton", "torch_native"}
    assert Registry._handlers["torch_native"](None, None) == "mla"
    assert Registry._handlers["triton"](None, None) == "mha"


def test_swa_layers_read_swa_slots_and_full_layers_full_slots() -> None:
    import sglang_cpu_patches as patches
    import torch

    table = torch.tensor([[3, 1, 2]], dtype=torch.int32)
    pool = SimpleNamespace(
        layers_mapping={0: (0, True), 1: (0, False)},
        translate_loc_from_full_to_swa=lambda idx: idx + 100,
    )
    seen: list[list[int]] = []

    def forward(self: Any, q: Any, k: Any, v: Any, layer: Any, fb: Any) -> str:
        seen.append(self.req_to_token_pool.req_to_token[0].tolist())
        if fb == "raise":
            raise RuntimeError("forward failed")
        return "out"

    wrapped = patches.read_swa_slots(forward)
    full_pool = SimpleNamespace(req_to_token=table)
    backend = SimpleNamespace(
        use_sliding_window_kv_pool=True,
        token_to_kv_pool=pool,
        req_to_token_pool=full_pool,
    )
    swa, full = SimpleNamespace(layer_id=0), SimpleNamespace(layer_id=1)
    assert wrapped(backend, 0, 0, 0, swa, None) == "out"
    assert wrapped(backend, 0, 0, 0, full, None) == "out"
    with pytest.raises(RuntimeError):
        wrapped(backend, 0, 0, 0, swa, "raise")
    assert backend.req_to_token_pool is full_pool  # restored, also after a raise
    backend.use_sliding_window_kv_pool = False  # e.g. a plain MHA pool (Llama)
    wrapped(backend, 0, 0, 0, swa, None)
    assert seen == [[103, 101, 102], [3, 1, 2], [103, 101, 102], [3, 1, 2]]
