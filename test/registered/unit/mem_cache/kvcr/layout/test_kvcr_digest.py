"""The compatibility digest covers everything that changes the KV bytes.

Identity part: each server setting that changes KV (weight quantization, config
overrides, KV scales, dtypes, load format, draft revision) and the checkpoint's
*content* (tiny model directories: a copy under another path shares, other weights
under one path do not). Weight updates: through the real (hooked)
``SchedulerWeightUpdaterManager`` methods on a real CPU stack with a real KVCR, an
update makes the linker refuse every page until the flush, which re-keys KVCR.
"""

from __future__ import annotations

import json
import os
import shutil
from array import array
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from cpu_harness import kvcr_stack, tiny_model
from cpu_harness.kvcr_pages import wait_until
from sglang.srt.mem_cache.storage.kvcr.layout import model_identity
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.rank_setup import kvcache_layout_identity
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration, weight_updates
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = [pytest.mark.kvcr, pytest.mark.usefixtures("plugin_hooks")]

PAGE = 4
WAIT_S = 10.0
POLL_S = 0.01


# ---- checkpoints ----------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> SimpleNamespace:
    """``a``: the tiny model; ``copy``: the same files elsewhere; ``other``: the
    same files but for weights from another seed (same names and sizes)."""
    root = tmp_path_factory.mktemp("ckpt")
    a = shutil.copytree(tiny_model.ensure_tiny_model(), root / "a")
    copy = shutil.copytree(a, root / "copy")
    other = shutil.copytree(a, root / "other")
    write_other_weights(other)
    return SimpleNamespace(a=Path(a), copy=Path(copy), other=Path(other))


def write_other_weights(path: Path) -> None:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    with mock.patch.object(tiny_model, "SEED", tiny_model.SEED + 1):
        tiny_model._write_weights(path, vocab_size=vocab)


def server_args(**kw: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "model_path": "org/model",
        "revision": None,
        "load_format": "auto",
        "dtype": "auto",
        "kv_cache_dtype": "auto",
        "quantization": None,
        "quantization_param_path": None,
        "json_model_override_args": "{}",
        "speculative_algorithm": None,
        "speculative_draft_model_path": None,
        "speculative_draft_model_revision": None,
    }
    return SimpleNamespace(**{**base, **kw})


def digest(args: Any) -> str:
    pool = MHATokenToKVPool(
        64, PAGE, torch.bfloat16, 2, 8, 2, device="cpu", enable_memory_saver=False
    )
    identity = kvcache_layout_identity(args, 0, 1)
    return PageLayout.from_kv_pool(pool, PAGE, identity=identity).compatibility_digest


SETTINGS = {
    "quantization": {"quantization": "fp8"},
    "json_model_override_args": {
        "json_model_override_args": '{"rope_scaling": {"type": "linear", "factor": 2}}'
    },
    "quantization_param_path": {"quantization_param_path": "/scales/kv.json"},
    "speculative_draft_model_revision": {
        "speculative_algorithm": "EAGLE",
        "speculative_draft_model_path": "org/draft",
        "speculative_draft_model_revision": "v2",
    },
    "kv_cache_dtype": {"kv_cache_dtype": "fp8_e5m2"},
    "dtype": {"dtype": "float16"},
    "load_format_dummy": {"load_format": "dummy"},
    "context_length": {"context_length": 4096},
    "model_path_hub_id": {"model_path": "org/other-model"},
}


@pytest.mark.parametrize("change", list(SETTINGS), ids=list(SETTINGS))
def test_each_kv_changing_setting_changes_the_digest(change: str, checkpoints):
    """One setting differs from the baseline (a local checkpoint, so the
    baseline's digest is stable): the digest differs."""
    local = {"model_path": str(checkpoints.a)}
    base = digest(server_args(**local))
    assert digest(server_args(**local)) == base
    assert digest(server_args(**{**local, **SETTINGS[change]})) != base


def test_draft_revision_changes_the_digest_of_a_speculative_worker(checkpoints):
    """Same draft path, another draft revision: other draft KV."""
    draft = {
        "model_path": str(checkpoints.a),
        "speculative_algorithm": "EAGLE",
        "speculative_draft_model_path": str(checkpoints.copy),
    }
    v1 = server_args(**draft, speculative_draft_model_revision="v1")
    assert digest(v1) == digest(
        server_args(**draft, speculative_draft_model_revision="v1")
    )
    v2 = server_args(**draft, speculative_draft_model_revision="v2")
    assert digest(v1) != digest(v2)


def test_settings_that_do_not_change_kv_bytes_keep_the_digest(checkpoints):
    """An empty override and an override spelled with other key order are equal."""
    local = {"model_path": str(checkpoints.a)}
    assert digest(server_args(json_model_override_args="", **local)) == digest(
        server_args(**local)
    )
    spaced = server_args(json_model_override_args='{"b": 1, "a": {"c": 2}}', **local)
    assert digest(spaced) == digest(
        server_args(json_model_override_args='{"a":{"c":2},"b":1}', **local)
    )


def test_weights_nothing_here_can_identify_share_with_no_other_worker(checkpoints):
    """A hub id with no local snapshot, or a load format that does not read the
    files (weights from a remote instance, IPC, a cache): two workers never
    share, even with identical arguments."""
    for args in (
        {"model_path": "org/not-cached-anywhere"},
        {"model_path": str(checkpoints.a), "load_format": "remote_instance"},
    ):
        assert digest(server_args(**args)) != digest(server_args(**args))


def test_kv_scale_file_is_hashed_by_content(tmp_path, checkpoints):
    """Same path, other scales: other digest; same scales elsewhere: same digest."""
    scales, moved = tmp_path / "kv.json", tmp_path / "moved.json"
    scales.write_text('{"k_scale": 0.5}')
    moved.write_text('{"k_scale": 0.5}')
    local = {"model_path": str(checkpoints.a)}
    before = digest(server_args(quantization_param_path=str(scales), **local))
    assert digest(server_args(quantization_param_path=str(moved), **local)) == before
    scales.write_text('{"k_scale": 0.25}')
    assert digest(server_args(quantization_param_path=str(scales), **local)) != before


def test_same_checkpoint_content_under_two_paths_shares_the_digest(checkpoints):
    assert checkpoints.a != checkpoints.copy
    assert digest(server_args(model_path=str(checkpoints.a))) == digest(
        server_args(model_path=str(checkpoints.copy))
    )


def test_other_weights_of_the_same_names_and_sizes_change_the_digest(checkpoints):
    """A seed change (same tensor names, shapes and file size) is other weights."""
    a, other = (
        checkpoints.a / "model.safetensors",
        checkpoints.other / "model.safetensors",
    )
    assert a.stat().st_size == other.stat().st_size
    assert a.read_bytes() != other.read_bytes()
    assert digest(server_args(model_path=str(checkpoints.a))) != digest(
        server_args(model_path=str(checkpoints.other))
    )


def test_other_weights_under_one_path_change_the_digest(tmp_path, checkpoints):
    path = Path(shutil.copytree(checkpoints.a, tmp_path / "model"))
    before = digest(server_args(model_path=str(path)))
    write_other_weights(path)
    assert digest(server_args(model_path=str(path))) != before


def test_another_config_json_changes_the_digest(tmp_path, checkpoints):
    path = Path(shutil.copytree(checkpoints.a, tmp_path / "model"))
    before = digest(server_args(model_path=str(path)))
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (path / "config.json").write_text(json.dumps(config))
    assert digest(server_args(model_path=str(path))) != before


def test_dummy_weights_ignore_the_files_but_not_the_config(checkpoints):
    """Dummy weights are random: not the checkpoint's weights, whatever its files."""
    real = digest(server_args(model_path=str(checkpoints.a)))
    dummy_a = digest(server_args(model_path=str(checkpoints.a), load_format="dummy"))
    dummy_other = digest(
        server_args(model_path=str(checkpoints.other), load_format="dummy")
    )
    assert dummy_a != real
    assert dummy_a == dummy_other  # same config.json, weights not read


def test_hub_cache_blob_names_are_used_as_content_hashes(tmp_path):
    """A snapshot symlink into HF's blobs/ is fingerprinted by the blob's SHA-256."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    name = "ab" * 32
    (blobs / name).write_bytes(b"x" * 100)
    (snap / "model.safetensors").symlink_to(blobs / name)
    fp = model_identity.weights_fingerprint(str(snap), "", "auto")
    (blobs / name).write_bytes(b"y" * 100)  # the name, not the bytes, is trusted
    assert model_identity.weights_fingerprint(str(snap), "", "auto") == fp
    other = "cd" * 32
    (blobs / other).write_bytes(b"x" * 100)
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(blobs / other)
    assert model_identity.weights_fingerprint(str(snap), "", "auto") != fp


# ---- weight updates on a real stack ---------------------------------------------


@pytest.fixture
def stack() -> Iterator[Any]:
    config = {
        "local_dram_bytes_per_worker": 4 * 1024 * 1024,
        "operation_timeout_ms": 5000,
        "abandon_timeout_ms": 10000,
        "preparation_timeout_ms": 10_000,
    }
    s = kvcr_stack.build_stack(config, kvcr_stack.Geometry(PAGE, 2, 2, 8, 256))
    try:
        yield s
    finally:
        s.linker.close()


def weight_manager(cache: Any) -> Any:
    """A real ``SchedulerWeightUpdaterManager`` whose runner loads nothing and
    whose flush is the tree's reset (as ``Scheduler.flush_cache`` does)."""
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )

    def flush(empty_cache: bool = True) -> bool:
        cache.reset()
        return True

    runner = SimpleNamespace(
        weight_updater=SimpleNamespace(
            update_weights_from_disk=lambda *a, **kw: (True, "ok"),
            update_weights_from_tensor=lambda **kw: (True, "ok"),
        )
    )
    manager = object.__new__(SchedulerWeightUpdaterManager)
    manager.tp_worker = SimpleNamespace(
        weight_update_runners=lambda: [("target", runner)],
        deserialize_own_rank=lambda blob: [],
    )
    manager.draft_worker = None
    manager.flush_cache = flush
    manager.metrics_collector = None
    manager.scheduler = SimpleNamespace(
        tree_cache=cache, record_weight_version_change=lambda **kw: None
    )
    manager._session = None
    manager.tp_cpu_group = None
    return manager


def update_from_disk(stack: Any, path: Path | str, *, flush: bool = True) -> Any:
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    # The test stack serves dummy weights; the update loads real files.
    req = UpdateWeightFromDiskReqInput(
        model_path=str(path), load_format="auto", flush_cache=flush
    )
    out = weight_manager(stack.cache).update_weights_from_disk(req)
    assert out.success, out.message
    return stack.linker.layout.compatibility_digest


def radix_key(tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def insert_commit_evict(stack: Any, tokens: list[int]) -> None:
    """Put ``tokens`` in KVCR (write-through offload) and off the device."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

    slots = stack.allocator.alloc(len(tokens))
    stack.cache.insert(InsertParams(key=radix_key(tokens), value=slots))
    wait_until(lambda: committed(stack.cache), WAIT_S, "offloads committed", POLL_S)
    stack.cache.evict(EvictParams(num_tokens=len(tokens)))


def committed(cache: Any) -> bool:
    cache.check_hicache_events()
    return not cache.linker.pending_offloads


def prepared_hit(stack: Any, rid: str, tokens: list[int], *, check=None) -> int:
    """Prepare ``tokens + [1]`` like the enqueue hook; optionally run ``check``
    between preparation and lookup; the host hit length its lookup reports."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", [*tokens, 1]), SamplingParams(max_new_tokens=1))
    integration.wrapper_prepare_request(stack.cache.linker, req)
    handle = LinkerRequestContext(req.rid, req.cache_request_handle.attempt_id).handle
    wait_until(
        lambda: stack.linker.preparation_ready(handle),
        WAIT_S,
        f"{rid} prepared",
        POLL_S,
    )
    if check is not None:
        check()
    req.init_next_round_input(stack.cache)
    hit = int(req.host_hit_length)
    stack.linker.release_request(rid)
    return hit


def test_weight_update_refuses_pages_until_the_flush_re_keys_kvcr(stack):
    """Without the flush the update still turns every lookup into a miss (pages
    prepared before it too); the flush changes the digest and KVCR works again."""
    tokens = list(range(100, 100 + 4 * PAGE))
    insert_commit_evict(stack, tokens)
    assert prepared_hit(stack, "before", tokens) == len(tokens)
    old = stack.linker.layout.compatibility_digest

    def update_without_flush() -> None:
        assert update_from_disk(stack, "/nonexistent/new-weights", flush=False) == old
        assert stack.linker.weights_pending

    assert prepared_hit(stack, "prepared", tokens, check=update_without_flush) == 0

    def nothing_fetched() -> None:
        assert stack.linker.claims_held() == 0  # no page of the old weights

    assert prepared_hit(stack, "after", tokens, check=nothing_fetched) == 0
    assert stack.linker.stats.refused_weights_changed >= 2

    stack.cache.reset()  # /flush_cache
    assert not stack.linker.weights_pending
    assert stack.linker.layout.compatibility_digest != old
    insert_commit_evict(stack, tokens)  # keyed with the new digest
    assert prepared_hit(stack, "new", tokens) == len(tokens)


def test_disk_update_keys_by_checkpoint_content(stack, checkpoints):
    """The same weights under another path give the same digest, other weights
    another; an in-memory (tensor) update gives one no disk checkpoint has."""
    start = stack.linker.layout.compatibility_digest
    a = update_from_disk(stack, checkpoints.a)
    assert a != start
    assert update_from_disk(stack, checkpoints.copy) == a
    assert update_from_disk(stack, checkpoints.other) != a
    assert not stack.linker.weights_pending

    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    manager = weight_manager(stack.cache)
    manager._session = SimpleNamespace(selector="all", loaded_weights=False)
    with (
        mock.patch("msgspec.structs.replace", lambda s, **kw: s),
        mock.patch("torch.distributed.barrier"),
    ):
        out = manager.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(serialized_named_tensors=[])
        )
    assert out.success, out.message
    tensor = stack.linker.layout.compatibility_digest
    assert tensor not in (start, a)
    assert update_from_disk(stack, checkpoints.copy) == a


def _session_manager(stack: Any) -> Any:
    manager = weight_manager(stack.cache)
    runner = manager.tp_worker.weight_update_runners()[0][1]
    runner.weight_updater.begin_weight_update = lambda: None
    runner.weight_updater.end_weight_update = lambda run_post_load: None
    return manager


def test_an_rl_weight_session_leaves_kvcr_serving_the_new_weights(stack):
    """begin, a tensor update (which flushes: re-keyed), end: KVCR works after
    end; a session whose weights were written without a load (P2P/RDMA) leaves
    pages refused until a flush re-keys them."""
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )

    manager = _session_manager(stack)
    start = stack.linker.layout.compatibility_digest
    with mock.patch("torch.distributed.barrier"):
        assert manager.begin_weight_update(BeginWeightUpdateReqInput()).success
        assert stack.linker.weights_pending  # pages refused while it runs
        out = manager.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(serialized_named_tensors=[])
        )
        assert out.success, out.message
        assert not stack.linker.weights_pending
        assert manager.end_weight_update(EndWeightUpdateReqInput()).success
    assert not stack.linker.weights_pending
    assert stack.linker.layout.compatibility_digest != start
    tokens = list(range(300, 300 + 2 * PAGE))
    insert_commit_evict(stack, tokens)
    assert prepared_hit(stack, "rl", tokens) == len(tokens)

    with mock.patch("torch.distributed.barrier"):
        assert manager.begin_weight_update(BeginWeightUpdateReqInput()).success
        stack.cache.reset()  # something flushed mid-session; no load ran
        assert manager.end_weight_update(EndWeightUpdateReqInput()).success
    assert stack.linker.weights_pending  # the weights changed unseen


def test_random_weights_and_resumed_weights_are_refused_until_a_flush(stack):
    """check_weights(reset_tensors) randomizes the weights, and resuming weight
    memory may leave them undefined: refused until the next flush; a checksum
    check or a KV-cache-only resume changes nothing."""
    from sglang.srt.managers.io_struct import (
        CheckWeightsReqInput,
        ResumeMemoryOccupationReqInput,
    )

    manager = _session_manager(stack)
    for name in ("check_weights", "resume_memory_occupation"):
        target = f"{weight_updates._WEIGHTS}.{name}"
        assert target in integration.WEIGHT_TARGETS
    hook = weight_updates.around_weight_update

    checks = [
        ("check_weights", CheckWeightsReqInput(action="checksum"), False),
        (
            "resume_memory_occupation",
            ResumeMemoryOccupationReqInput(tags=["kv_cache"]),
            False,
        ),
        ("check_weights", CheckWeightsReqInput(action="reset_tensors"), True),
        (
            "resume_memory_occupation",
            ResumeMemoryOccupationReqInput(tags=["weights"]),
            True,
        ),
        ("resume_memory_occupation", ResumeMemoryOccupationReqInput(tags=None), True),
    ]
    for name, req, changes in checks:
        hook(_named(name), manager, req)
        assert stack.linker.weights_pending is changes, (name, req)
        stack.cache.reset()
    # With a CPU backup of the weights, a resume brings back the same weights.
    with mock.patch.object(weight_updates, "_weights_backed_up", return_value=True):
        resume = ResumeMemoryOccupationReqInput(tags=["weights"])
        hook(_named("resume_memory_occupation"), manager, resume)
    assert not stack.linker.weights_pending


def _named(name: str) -> Any:
    def original(manager: Any, req: Any) -> Any:
        return SimpleNamespace(success=True)

    original.__name__ = name
    return original


def test_lora_adapters_are_part_of_the_digest_by_content(tmp_path, checkpoints):
    """Startup adapters' ids come from name and path alone (the same on every
    worker), so the digest carries their content: other weights or another
    adapter config under the same name and path change it; a copy of the same
    adapter elsewhere under the same name does not."""
    from sglang.srt.lora.lora_registry import LoRARef

    def adapter(where: str, weights: bytes, rank: int) -> Path:
        path = tmp_path / where
        path.mkdir()
        (path / "adapter_model.safetensors").write_bytes(weights)
        (path / "adapter_config.json").write_text(json.dumps({"r": rank}))
        return path

    def with_lora(path: Path, name: str = "sql") -> str:
        ref = LoRARef(lora_name=name, lora_path=str(path))
        return digest(server_args(model_path=model, lora_paths=[ref]))

    model = str(checkpoints.a)
    base = digest(server_args(model_path=model))
    v1 = adapter("v1", b"weights-1" * 100, 8)
    copy = adapter("copy", b"weights-1" * 100, 8)
    v2 = adapter("v2", b"weights-2" * 100, 8)
    wider = adapter("wider", b"weights-1" * 100, 16)
    assert with_lora(v1) != base
    assert with_lora(v1) == with_lora(v1)  # another worker, same adapter
    # (A copy elsewhere has another id, so other keys: the digest may differ.)
    assert with_lora(copy) != base
    assert with_lora(v1) != with_lora(v2)
    assert with_lora(v1) != with_lora(wider)
    assert with_lora(v1) != with_lora(v1, name="other")
    # The CLI's "name=path" strings mean the same adapters.
    assert digest(server_args(model_path=model, lora_paths=[f"sql={v1}"])) == (
        with_lora(v1)
    )


def test_a_failed_update_leaves_the_worker_refusing_pages(stack):
    """A disk update that fails announces unknown weights: refused until a flush."""
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    manager = weight_manager(stack.cache)
    runner = manager.tp_worker.weight_update_runners()[0][1]
    runner.weight_updater.update_weights_from_disk = lambda *a, **kw: (False, "bad")
    old = stack.linker.layout.compatibility_digest
    out = manager.update_weights_from_disk(
        UpdateWeightFromDiskReqInput(model_path="/nonexistent")
    )
    assert not out.success
    assert stack.linker.weights_pending
    stack.cache.reset()
    assert stack.linker.layout.compatibility_digest != old


def test_a_change_anywhere_in_a_weight_file_changes_its_fingerprint(tmp_path):
    """Every byte counts (a sampled hash missed a change between its samples):
    one changed KiB deep inside a file gives another fingerprint; a copy of the
    file elsewhere gives the same one."""
    from sglang.srt.mem_cache.storage.kvcr.layout import model_identity

    data = bytearray(os.urandom(3 << 20))
    a, b, c = (
        tmp_path / n for n in ("a.safetensors", "b.safetensors", "c.safetensors")
    )
    a.write_bytes(data)
    b.write_bytes(data)
    data[1_234_567 : 1_234_567 + 1024] = os.urandom(1024)
    c.write_bytes(data)
    fp = [model_identity.weights_fingerprint(str(p), "", "auto") for p in (a, b, c)]
    assert fp[0] == fp[1] and fp[0] != fp[2]
