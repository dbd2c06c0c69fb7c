"""KVCR-linker CPU servers and a KV-event subscriber, for end-to-end tests.

``launch_linker`` starts (without waiting) a CPU SGLang server with the KVCR linker
on a free control port and records its endpoint; ``run`` sends one greedy request
and returns its output and how many tokens came from external KVCR pages;
``computed_on`` / ``recompute`` are the control runs. ``launch_family`` and
``family_round_trip`` (``family_round_trips``: several servers at once) do the
evict-and-replay round trip on a seeded-weight tiny model of another family
(``tiny_family_models``) and return a ``FamilyReplay``, whose ``checks`` are the
criteria of a correct one. ``EventSubscriber`` reads a worker's ``KVEventBatch``
messages from SGLang's own ZMQ publisher (``--kv-events-config``) on a thread, and
``published_chain`` walks them the way a KV-aware router does: page by page from
the sequence head, by tokens and parent link, returning the block hashes the
worker published for a prompt.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import random
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cpu_harness import server as harness
from cpu_harness import tiny_family_models as families

PAGE = 16
OUTPUT_LEN = 8
DEFAULT_CONFIG = {
    "local_dram_bytes_per_worker": 64 << 20,
    "operation_timeout_ms": 10000,
    "abandon_timeout_ms": 20000,
    "preparation_timeout_ms": 5000,
}


def launch_linker(
    name: str,
    model: Path,
    work: Path,
    extra: Sequence[str] = (),
    *,
    prompt_len: int = 256,
    config: dict[str, Any] | None = None,
) -> Any:
    """A KVCR-linker server started without waiting (``handle.wait_ready``)."""
    control_port = harness.free_port()
    cfg = {**DEFAULT_CONFIG, "control_port": control_port, **(config or {})}
    args = [
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        str(4 * prompt_len),
        "--max-running-requests",
        "4",
        *extra,
        *harness.kvcr_linker_args(cfg),
    ]
    handle = harness.launch_server(
        args, model_path=model, log_path=work / f"{name}.log", wait=False
    )
    handle.endpoint = f"tcp://127.0.0.1:{control_port}"
    return handle


def run(server: Any, ids: list[int], **extra: Any) -> tuple[list[int], int]:
    """(output ids, tokens restored from external KVCR pages) of one request."""
    out = server.generate(input_ids=ids, max_new_tokens=OUTPUT_LEN, **extra)
    meta = out.get("meta_info", {})
    external = int((meta.get("cached_tokens_details") or {}).get("host", 0) or 0)
    return list(out["output_ids"]), external


def computed_on(server: Any, ids: list[int], **extra: Any) -> list[int]:
    """``ids`` computed (and offloaded) on ``server``: its output."""
    output, _ = run(server, ids, **extra)
    time.sleep(1.0)  # the write-through offload to KVCR DRAM is asynchronous
    return output


def recompute(server: Any, ids: list[int], **extra: Any) -> list[int]:
    """``server``'s own output for ``ids`` with nothing cached."""
    assert server.flush_cache().status_code == 200
    output, external = run(server, ids, **extra)
    assert external == 0
    return output


FAMILY_NAMES = {"mla": "MLA", "swa": "FULL+SWA"}  # as the linker logs them
FAMILY_PROMPT_LEN = 128  # 7 aligned pages: more than the SWA window's 4
FAMILY_RE = re.compile(r"KVCR model family (\S+): pools")
LAYOUT_RE = re.compile(r"KVCR page layout \w+: pools=(\[.*\]) layers=\d+")
STATS_FIELD_RE = re.compile(r"\b(\w+)=(-?\d+)\b")
TOP_LOGPROBS = 2
FILLERS = 6  # the device pool holds 4 prompts (launch_linker): 1.5 pools over


class RoundTripError(RuntimeError):
    """A family round trip's server refused a step (e.g. ``/flush_cache``)."""


def launch_family(
    family: str,
    work: Path,
    *,
    prompt_len: int = FAMILY_PROMPT_LEN,
    extra: Sequence[str] = (),
) -> Any:
    """A KVCR-linker server on ``family``'s seeded-weight tiny model (built once
    under the harness cache), logging into ``work``, started without waiting."""
    root = harness.cache_dir() / "family-models"
    model = families.ensure_family_model(family, root / family, weights=True)
    handle = launch_linker(family, model, work, extra, prompt_len=prompt_len)
    handle.family = family
    handle.model_config = json.loads((model / "config.json").read_text())
    return handle


def greedy(server: Any, ids: list[int]) -> dict[str, Any]:
    """One greedy request with its logprobs (chosen and top two per token) and
    where its cached tokens came from."""
    out = server.generate(
        input_ids=ids,
        max_new_tokens=OUTPUT_LEN,
        return_logprob=True,
        top_logprobs_num=TOP_LOGPROBS,
    )
    meta = out["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return {
        "output_ids": list(out["output_ids"]),
        "logprobs": [float(x[0]) for x in meta["output_token_logprobs"]],
        "top": [[float(x[0]) for x in top] for top in meta["output_top_logprobs"]],
        "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
        "device": int(details.get("device", 0) or 0),
        "host": int(details.get("host", 0) or 0),
    }


@dataclasses.dataclass
class FamilyReplay:
    """One family's round trip: the replay after device eviction, the recompute
    after ``/flush_cache`` (the control), and the stopped server's log;
    ``startup_s`` is from launch to ready, ``wall_s`` the round trip after it."""

    family: str
    model_config: dict[str, Any]
    aligned: int
    replay: dict[str, Any]
    control: dict[str, Any]
    log: str
    startup_s: float
    wall_s: float

    def logged_family(self) -> str | None:
        found = FAMILY_RE.findall(self.log)
        return found[-1] if found else None

    def stats(self) -> dict[str, int]:
        """The integer fields of the last ``KVCR_STATS`` line (at shutdown)."""
        lines = [ln for ln in self.log.splitlines() if "KVCR_STATS " in ln]
        return (
            {k: int(v) for k, v in STATS_FIELD_RE.findall(lines[-1])} if lines else {}
        )

    def layout_page_bytes(self) -> dict[str, int]:
        """Bytes per page of each pool over its layers, as the linker logged its
        layout (page bytes per span times spans)."""
        found = LAYOUT_RE.findall(self.log)
        pools = ast.literal_eval(found[-1]) if found else []
        return {name: spans * nbytes for name, _policy, spans, nbytes in pools}

    def restored_pages(self) -> dict[str, int]:
        """Pages a correct restore copies per pool: every aligned page of KV, and
        only the trailing window of a sliding-window pool."""
        pages = self.aligned // PAGE
        pools = {"kv": pages}
        if "sliding_window" in self.model_config:
            window = math.ceil(self.model_config["sliding_window"] / PAGE)
            pools["swa"] = min(pages, window)
        return pools

    def expected_restored_bytes(self) -> int:
        sizes = families.pool_page_bytes(self.model_config, PAGE)
        return sum(n * sizes[pool] for pool, n in self.restored_pages().items())

    def logprob_gap(self) -> float:
        """The largest distance of a chosen logprob from uniform (-ln vocab)."""
        uniform = -math.log(self.model_config["vocab_size"])
        return max(abs(lp - uniform) for lp in self.control["logprobs"])

    def checks(self, logprob_tol: float = 1e-4) -> dict[str, bool]:
        """Each criterion of a correct round trip, by name."""
        r, c = self.replay, self.control
        return {
            "restored_tokens": r["host"] == self.aligned > 0,
            "real_hit": r["cached_tokens"] == r["host"]
            and r["device"] == 0
            and c["host"] == c["device"] == 0
            and self.stats().get("load_pages") == self.aligned // PAGE,
            "output_matches_recompute": r["output_ids"] == c["output_ids"],
            "logprobs_match_recompute": len(r["logprobs"]) == len(c["logprobs"])
            and all(
                abs(a - b) <= logprob_tol
                for a, b in zip(r["logprobs"], c["logprobs"], strict=True)
            ),
            "logits_not_uniform": self.logprob_gap() > 1.0,
            "family_logged": self.logged_family() == FAMILY_NAMES[self.family],
            "layout_matches_geometry": self.layout_page_bytes()
            == families.pool_page_bytes(self.model_config, PAGE),
            "restored_bytes": self.stats().get("restored_bytes")
            == self.expected_restored_bytes(),
        }


def family_round_trip(
    server: Any,
    *,
    prompt_len: int = FAMILY_PROMPT_LEN,
    seed: int = 11,
    ready_s: float = 420.0,
) -> FamilyReplay:
    """Compute a prompt on ``server`` (from ``launch_family``), evict it from the
    device with filler prompts, replay it, then flush and recompute it; stop the
    server and return what was seen."""
    startup_s = server.wait_ready(ready_s)
    started = time.monotonic()
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(3, 300) for _ in range(prompt_len)]

    try:
        ids = prompt()
        computed_on(server, ids)
        for _ in range(FILLERS):
            run(server, prompt())
        time.sleep(1.0)  # the fillers' offloads settle before the replay
        replay = greedy(server, ids)
        flushed = server.flush_cache()
        if flushed.status_code != 200:
            raise RoundTripError(f"/flush_cache answered {flushed.status_code}")
        control = greedy(server, ids)
    finally:
        server.stop()
    return FamilyReplay(
        family=server.family,
        model_config=server.model_config,
        aligned=(prompt_len - 1) // PAGE * PAGE,
        replay=replay,
        control=control,
        log=server.log_text(),
        startup_s=round(startup_s, 2),
        wall_s=round(time.monotonic() - started, 2),
    )


def family_round_trips(
    servers: Sequence[Any], *, prompt_len: int = FAMILY_PROMPT_LEN
) -> dict[str, FamilyReplay | Exception]:
    """``family_round_trip`` on every server at once (one thread each), by
    family; a server whose round trip raised gets its exception (stopped too)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(server: Any) -> FamilyReplay | Exception:
        try:
            return family_round_trip(server, prompt_len=prompt_len)
        except Exception as exc:  # the other families' results stay theirs
            server.stop()
            return exc

    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        return dict(
            zip((s.family for s in servers), pool.map(one, servers), strict=True)
        )


def kv_events_args(port: int, *, dynamo: bool = False) -> list[str]:
    """Flags that make a server publish KV events on ``127.0.0.1:port``."""
    config: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "bind": True,
        "topic": "kv",
    }
    if dynamo:
        config["format"] = "dynamo"
    return ["--kv-events-config", json.dumps(config)]


class EventSubscriber:
    """Collects a worker's published KV events (a daemon thread, bounded waits)."""

    def __init__(self, port: int) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._lock = threading.Lock()
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        import msgspec
        import zmq
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = decoder.decode(payload)
            with self._lock:
                self.events.extend(batch.events)

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self.events)

    def published_chain(
        self, ids: list[int], pages: int, *, medium: str = "EXTERNAL"
    ) -> list[int] | None:
        """The block hashes the worker published (on ``medium``) for the first
        ``pages`` pages of ``ids``, walked by tokens and parent link; None until
        every page has been published."""
        from sglang.srt.disaggregation.kv_events import BlockStored

        by_link: dict[tuple[int | None, tuple[int, ...]], int] = {}
        for event in self.snapshot():
            if not isinstance(event, BlockStored) or event.medium != medium:
                continue
            parent = event.parent_block_hash
            for i, block in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[i * PAGE : (i + 1) * PAGE])
                by_link[(parent, tokens)] = block
                parent = block
        chain: list[int] = []
        parent = None
        for p in range(pages):
            block = by_link.get((parent, tuple(ids[p * PAGE : (p + 1) * PAGE])))
            if block is None:
                return None
            chain.append(block)
            parent = block
        return chain

    def wait_chain(
        self, ids: list[int], pages: int, timeout: float = 30.0
    ) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chain = self.published_chain(ids, pages)
            if chain is not None:
                return chain
            time.sleep(0.2)
        raise AssertionError(f"no EXTERNAL BlockStored chain of {pages} pages seen")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close(linger=0)
        self._ctx.term()
