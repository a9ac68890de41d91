"""The main KV pool's format is the operator's (`--kv-quant`, model dtype by default), never the
pressure level at load: a PSI blip while `ballast serve` loaded used to make the whole main pool
int8 for the life of the process. The blip is a real /proc tree (BALLAST_MEMORY_ROOT) showing PSI
some > 0 (WATCH) from the start; the server is the real `ballast serve` in a child process, asked
through the openai client and read from /metrics and its start-up log."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from ballast.memory.types import GiB
from memfixtures import write_tree
from prometheus_client.parser import text_string_to_metric_families
from serverproc import serve_subprocess

MESSAGES = [{"role": "user", "content": "hello there"}]


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)
        for s in family.samples
    }


@pytest.mark.slow
def test_a_psi_blip_at_load_leaves_the_main_pool_in_the_model_dtype(tmp_path: Path) -> None:
    write_tree(tmp_path, mem_total=64 * GiB, mem_available=48 * GiB, psi_some=2.5)  # WATCH by PSI alone
    output: list[str] = []
    args = ["--model", "builtin:tiny-llama", "--max-model-len", "256", "--max-num-seqs", "2"]
    with serve_subprocess(args, {"BALLAST_MEMORY_ROOT": str(tmp_path)}, output=output) as (url, _):
        m = samples(url)
        assert m[("ballast_memory_pressure_level", ())] == 1  # the engine loaded at WATCH
        # The int8 pool beside the main one (for the sequences WATCH starts in int8) exists only
        # while the main pool is not int8 itself.
        pools = {dict(labels)["pool"] for name, labels in m if name == "ballast_kv_pool_bytes"}
        assert pools == {"main", "int8"}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model="builtin:tiny-llama",
            messages=MESSAGES,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=4,
        )
        assert r.usage is not None and r.usage.completion_tokens >= 1
    [capacity] = [line for line in output if "capacity: KV room" in line]
    assert "(model dtype," in capacity
