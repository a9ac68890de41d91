"""A thinking template: the default model (SmolLM2-135M-Instruct) served with its own tokenizer
under a Qwen3-style chat template (it opens `<think>` in the generation prompt, or writes an empty
`<think></think>` when `enable_thinking` is false). Two earlier turns show the model the form, so
it writes its thinking, `</think>`, then the answer; all three APIs give the thinking apart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.models.weights.default_model import default_model_path
from ballast.models.weights.gguf_loader import build_tokenizer, read_gguf
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from serverproc import running_server

pytestmark = pytest.mark.slow

QWEN3_STYLE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{%- endif %}"
    "{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)
# Earlier turns carry their thinking under both names clients use; the template gets it either way.
SHOWN: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning_content": "2+2 is 4.", "content": "4"},
    {"role": "user", "content": "What is 3+3?"},
    {"role": "assistant", "reasoning": "3+3 is 6.", "content": "6"},
    {"role": "user", "content": "What is 4+4?"},
]
THOUGHT, ANSWER = "4+4 is 8.", "8"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tok_dir = Path(tmp_path_factory.mktemp("qwen3-style-tokenizer"))
    hf = build_tokenizer(read_gguf(default_model_path()).metadata)
    hf.chat_template = QWEN3_STYLE
    hf.save_pretrained(str(tok_dir))
    config = EngineConfig(
        model="default",
        tokenizer=str(tok_dir),
        device="cpu",
        dtype="float32",
        max_num_seqs=2,
        max_model_len=512,
    )
    app = create_app(
        ServerConfig(), SchedulerConfig(), lambda: Engine.load(config), model_aliases=("default",)
    )
    with running_server(app, timeout_s=180) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_gives_the_thinking_apart_whole_and_streamed(oai: openai.OpenAI) -> None:
    done = oai.chat.completions.create(model="default", messages=SHOWN, max_tokens=30, temperature=0)  # type: ignore[arg-type]
    message = done.model_dump()["choices"][0]["message"]
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == (
        THOUGHT,
        THOUGHT,
        ANSWER,
    )
    thought, content = "", ""
    stream = oai.chat.completions.create(
        model="default", messages=SHOWN, max_tokens=30, temperature=0, stream=True
    )  # type: ignore[arg-type]
    for chunk in stream:
        delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
        thought += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
    assert (thought, content) == (THOUGHT, ANSWER)


def test_enable_thinking_false_renders_the_no_think_form(oai: openai.OpenAI, base_url: str) -> None:
    off = oai.chat.completions.create(
        model="default",
        messages=SHOWN,  # type: ignore[arg-type]
        max_tokens=30,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    on = oai.chat.completions.create(model="default", messages=SHOWN, max_tokens=30, temperature=0)  # type: ignore[arg-type]
    assert "reasoning_content" not in off.model_dump()["choices"][0]["message"]
    assert off.choices[0].message.content
    # The no-think form is the empty thinking block: "\n\n</think>\n\n" after the "<think>" both have.
    assert off.usage is not None and on.usage is not None and off.usage.prompt_tokens > on.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(
            model="default",
            messages=SHOWN,  # type: ignore[arg-type]
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )
    assert refused.value.param == "chat_template_kwargs"


def test_messages_give_a_thinking_block(base_url: str) -> None:
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    turns: Any = [
        {"role": m["role"], "content": m["content"]}
        if m["role"] == "user"
        else {
            "role": "assistant",
            "content": [
                {
                    "type": "thinking",
                    "thinking": m.get("reasoning_content") or m["reasoning"],
                    "signature": "",
                },
                {"type": "text", "text": m["content"]},
            ],
        }
        for m in SHOWN
    ]
    msg = claude.messages.create(
        model="default", max_tokens=30, messages=turns, extra_body={"temperature": 0}
    )
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
        ("thinking", THOUGHT),
        ("text", ANSWER),
    ]
    with claude.messages.stream(
        model="default", max_tokens=30, messages=turns, extra_body={"temperature": 0}
    ) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]  # type: ignore[union-attr]
        final = s.get_final_message()
    assert "thinking_delta" in deltas and "text_delta" in deltas
    assert [b.type for b in final.content] == ["thinking", "text"]


def test_responses_give_a_reasoning_item(oai: openai.OpenAI) -> None:
    items: Any = []
    for m in SHOWN:
        if m["role"] == "assistant":
            items.append(
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [
                        {"type": "reasoning_text", "text": m.get("reasoning_content") or m["reasoning"]}
                    ],
                }
            )
        items.append({"role": m["role"], "content": m["content"]})
    response = oai.responses.create(model="default", input=items, max_output_tokens=30, temperature=0)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"] and response.output_text == ANSWER
    assert response.output[0].content[0].text == THOUGHT  # type: ignore[union-attr,index]
    with oai.responses.stream(model="default", input=items, max_output_tokens=30, temperature=0) as s:
        events = list(s)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == THOUGHT and events[-1].type == "response.completed"
