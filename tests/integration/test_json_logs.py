"""`ballast serve --log-format json`: every line the process prints is one JSON object; a
request, its verdict, its end, a refusal and a level change are each logged once, with the
request id; prompt text never appears unless --log-prompts asks for it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from ballast.memory.config import MemoryConfig
from ballast.memory.types import Level
from memfixtures import level_tree
from serverproc import serve_subprocess

SECRET = "zebra quilt marmalade"


def _wait_for(url: str, status: int) -> None:
    deadline = time.monotonic() + 20
    while httpx.get(url + "/ready").status_code != status:
        assert time.monotonic() < deadline, f"/ready never answered {status}"
        time.sleep(0.05)


def _run(tmp_path: Path, extra: list[str]) -> list[dict[str, Any]]:
    level_tree(tmp_path, Level.OK, config=MemoryConfig(root=str(tmp_path)))
    out: list[str] = []
    args = [
        "--model",
        "builtin:tiny-llama",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "2",
        "--log-format",
        "json",
        "--memory-root",
        str(tmp_path),
        "--memwatch-poll-s",
        "0.05",
        *extra,
    ]
    with serve_subprocess(args, output=out) as (url, _):
        body = {"model": "builtin:tiny-llama", "prompt": SECRET, "max_tokens": 4}
        ok = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200
        level_tree(tmp_path, Level.CRITICAL, config=MemoryConfig(root=str(tmp_path)))
        _wait_for(url, 503)
        refused = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503
    assert out, "the server printed nothing"
    for line in out:
        record = json.loads(line)  # every line, uvicorn's and libraries' included
        assert isinstance(record, dict) and {"ts", "level", "logger", "msg"} <= set(record), line
        assert "\x1b[" not in line, line  # no terminal colour codes
    assert ok.json()["id"] and refused.json()["error"]["code"] == "server_overloaded"
    return [json.loads(line) for line in out]


def test_json_log_events_once_each_and_no_prompt_text(tmp_path: Path) -> None:
    records = _run(tmp_path, [])
    events: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if "event" in r:
            events.setdefault(r["event"], []).append(r)
    assert [e["url"].startswith("http://127.0.0.1:") for e in events["listening"]] == [True]
    # The second, refused at CRITICAL before its prompt was built (refuse_early), logs its refusal
    # alone: there is no prompt to describe.
    [request] = events["request"]
    first = request["request_id"]
    assert [(v["request_id"], v["verdict"]) for v in events["verdict"]] == [(first, "admit")]
    [finished] = events["finished"]
    assert (
        finished["request_id"] == first
        and finished["outcome"] == "length"
        and finished["completion_tokens"] == 4
    )
    [refusal] = events["refused"]
    assert refusal["request_id"] != first and refusal["status"] == 503 and "CRITICAL" in refusal["reason"]
    assert [(e["from"], e["to"]) for e in events["level"]] == [("OK", "CRITICAL")]
    assert all(SECRET not in json.dumps(r) for r in records)
    assert "prompt" not in request


def test_prompts_are_logged_only_when_asked(tmp_path: Path) -> None:
    records = _run(tmp_path, ["--log-prompts"])
    prompts = [r["prompt"] for r in records if r.get("event") == "request"]
    assert prompts == [SECRET]  # the refused one's prompt was never built (refuse_early)
