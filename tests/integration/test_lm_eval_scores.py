"""lm-evaluation-harness scores a small local multiple-choice task the same through ballast's
/v1/completions (`local-completions`) as through its `hf` model on the same weights (the default
model's GGUF, loaded by transformers): every choice's log-likelihood within 1e-3 nats, the
choices after which the model's next token is its EOS included (lm-eval drops the last logprob
entry, so a missing EOS entry cost the answer's last real token)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.models.weights.default_model import default_model_path
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from serverproc import running_server

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("What is 9 - 3?", ["6", "5", "12"], 0),
    ("What is the capital of France?", ["Paris", "Rome", "Berlin"], 0),
    ("What colour is the sky on a clear day?", ["blue", "green", "red"], 0),
    ("How many legs does a spider have?", ["eight", "six", "four"], 0),
]
TASK = """task: ballast_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(tmp_path_factory.mktemp("lm-eval-task"))
    data = root / "test.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS)
    )
    (root / "ballast_mc.yaml").write_text(TASK.format(data=data))
    return root


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    config = EngineConfig(model="default", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=512)
    app = create_app(
        ServerConfig(), SchedulerConfig(), lambda: Engine.load(config), model_aliases=("default",)
    )
    with running_server(app, timeout_s=180) as url:
        yield url


def _scores(lm: Any, task_dir: Path) -> list[float]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # Only the task written here: indexing lm-eval's thousands of bundled tasks took 21 s a call.
    out = simple_evaluate(
        model=lm,
        tasks=["ballast_mc"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
    )
    assert out is not None
    samples = sorted(out["samples"]["ballast_mc"], key=lambda s: s["doc_id"])
    return [float(r[0][0]) for s in samples for r in s["resps"]]


def test_local_completions_scores_as_the_hf_model(base_url: str, task_dir: Path) -> None:
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    reference = _scores(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4), task_dir)
    served = _scores(
        LocalCompletionsAPI(
            base_url=base_url + "/v1/completions",
            model="default",
            tokenizer_backend="remote",
            num_concurrent=4,
            max_retries=1,
        ),
        task_dir,
    )
    assert len(served) == len(reference) == sum(len(c) for _, c, _ in QUESTIONS)
    # The case the old server scored wrong: a choice after which the model's next token is EOS.
    eos_next = httpx.post(
        base_url + "/v1/completions",
        json={
            "model": "default",
            "prompt": "Question: What is 9 - 3?\nAnswer: 6",
            "max_tokens": 1,
            "temperature": 0,
        },
    ).json()
    assert eos_next["choices"][0]["finish_reason"] == "stop"
    worst = max(abs(a - b) for a, b in zip(served, reference, strict=True))
    assert worst < 1e-3, list(zip(served, reference, strict=True))
