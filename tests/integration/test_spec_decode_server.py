"""`ballast serve --speculative-config` (the env form too) on the default model, driven by the
official client: a copy answer streams every token with its logprob, n > 1 choices agree with the
single answer, /metrics shows what was drafted and accepted by position; a bad config refuses to
start with a clear message."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
from openai import OpenAI
from serverproc import serve_subprocess

SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'
TEXT = (
    "The keeper climbed the stairs each evening with a brass lamp and a notebook of the weather, the "
    "ships and the birds that nested in the rocks below the light."
)
ARGS = ["--max-num-seqs", "4", "--max-model-len", "1024"]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match is not None, name
    return float(match.group(1))


def test_drafting_over_http_streams_every_token_and_the_metrics_show_it() -> None:
    with serve_subprocess(ARGS, {"BALLAST_SPECULATIVE_CONFIG": SPEC}) as (base, _):
        client = OpenAI(base_url=base + "/v1", api_key="x")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Repeat exactly:\n\n" + TEXT}]
        whole = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=60)  # type: ignore[arg-type]
        stream = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=60,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
        )
        parts, logprobs, usage = [], 0, None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                logprobs += len(chunk.choices[0].logprobs.content or []) if chunk.choices[0].logprobs else 0
            usage = chunk.usage or usage
        assert "".join(parts) == whole.choices[0].message.content
        assert usage is not None and logprobs == usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
        several = client.chat.completions.create(  # type: ignore[call-overload]
            model=model, messages=messages, temperature=0, max_tokens=60, n=2
        )
        assert [c.message.content for c in several.choices] == [whole.choices[0].message.content] * 2
        metrics = httpx.get(base + "/metrics").text
    drafted = _metric(metrics, "ballast_spec_draft_tokens_total")
    accepted = _metric(metrics, "ballast_spec_accepted_tokens_total")
    assert drafted > 0 and accepted > drafted / 2
    assert re.search(r'^ballast_spec_acceptance\{position="0"\} (0\.[5-9]|1\.0)', metrics, re.M)
    assert re.search(r'^ballast_spec_steps_total\{drafting="yes"\} [1-9]', metrics, re.M)


def test_a_bad_speculative_config_stops_the_start_with_a_clear_error() -> None:
    cmd = [sys.executable, "-m", "ballast.server.cli", "serve", "--port", "0"]
    done = subprocess.run(
        [*cmd, "--speculative-config", '{"method": "eagle"}'], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "speculative-config" in done.stderr + done.stdout and "eagle" in done.stderr + done.stdout
