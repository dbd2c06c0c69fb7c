"""Explicit-hint peer reuse against a running pair (see launch_pair.sh).

Sends a prompt to worker A, then the same prompt to worker B with a kv.fetch@1.0
hint naming A's KVCR control endpoint and the prompt's page hashes, and prints how
many tokens B served from KVCR ("host" in cached_tokens_details) and whether the
greedy outputs match.

    python peer_reuse_check.py --a http://127.0.0.1:30000 --b http://127.0.0.1:30001 \
        --a-control tcp://127.0.0.1:47000 --page-size 64 --prompt-len 3000
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import requests
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import page_hash_to_u64


def generate(url: str, ids: list[int], **extra: object) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }
    body.update(extra)
    resp = requests.post(f"{url}/generate", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="http://127.0.0.1:30000")
    p.add_argument("--b", default="http://127.0.0.1:30001")
    p.add_argument("--a-control", default="tcp://127.0.0.1:47000")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=3000)
    p.add_argument("--vocab", type=int, default=30000)
    args = p.parse_args()
    if args.prompt_len <= args.page_size:
        p.error("--prompt-len must exceed --page-size")
    rng = random.Random(0)
    ids = [rng.randrange(10, args.vocab) for _ in range(args.prompt_len)]
    a = generate(args.a, ids)
    time.sleep(1.0)  # A's write-through offload to KVCR DRAM is asynchronous
    usable = (len(ids) - 1) // args.page_size * args.page_size
    hashes = [
        page_hash_to_u64(h)
        for h in get_storage_hash_str(
            RadixKey(ids[:usable]), None, page_size=args.page_size
        )
    ]
    hint = {
        "protocol_version": "1.0",
        "message_id": "peer-reuse-check",
        "actions": [
            {
                "action_id": "fetch-0",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {
                    "source_control_endpoint": args.a_control,
                    "block_hashes": hashes,
                },
            }
        ],
    }
    b = generate(args.b, ids, kv_hints=hint)
    details = b["meta_info"].get("cached_tokens_details") or {}
    external = int(details.get("host", 0))
    same = a.get("output_ids") == b.get("output_ids")
    print(
        f"B served {external}/{usable} prompt tokens from KVCR; outputs match: {same}"
    )
    return 0 if same and external >= 0.9 * usable else 1


if __name__ == "__main__":
    sys.exit(main())
