"""What each CPU weight form of the default model costs in accuracy and gains in speed, one run:
--cpu-weights dense (float32), blocks (the GGUF's blocks, float32 activations: the default where
its kernel builds), and FORM+bf16 (with --cpu-prefill bfloat16: prompt chunks' linears and
attention in bfloat16). (Its s20 rows of int4, torch's weight-only kernels, since removed, and
int8: docs/benchmarks-history.md.)

Against transformers on the float32 weights:
- max |d logit| and greedy choices changed, teacher-forced over the parity prompts
  (tests/integration/test_engine_parity.py: 4 prompts x 12 greedy steps);
- echo logprobs (every prompt token's logprob, as lm-eval's loglikelihood reads them) of four
  question/answer texts: max |d| in nats (the lm-eval test holds float32 to 1e-3);
- the chat answer to "What is the capital of France?" (greedy, 48 tokens): Paris or not;
- a long prompt (the first LONG_TOKENS tokens of ballast's own module docstrings, English prose),
  prefilled in the server's 512-token chunks: every token's logprob against the reference's
  (max and mean |d| in nats, next-token choices changed), and the prefill's wall time (the
  TTFT of that prompt in process, best of 2);
- a batch-1 decode step (Engine.step at 1 thread, median of --steps; the engine's thread time
  too, which another process's burst on the shared box does not inflate), and weights held.

    python -m ballast.bench.cpu_weight_tolerance [--steps 40]
        [--forms dense blocks blocks+bf16 dense+bf16]

Table on stdout, JSON to bench/results/cpu_weight_tolerance.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.generate import generate_stream
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.engine.runner.model_runner import weights_bytes
from ballast.models.arch.llama import LlamaForCausalLM

RESULTS = Path(__file__).parent / "results" / "cpu_weight_tolerance.json"
FORMS = ("dense", "blocks", "blocks+bf16", "dense+bf16")
LONG_TOKENS = 2000
CHUNK = 512  # the CPU's default prefill chunk
GREEDY = SamplingParams(temperature=0.0)
ECHO = [
    "Question: What is 9 - 3?\nAnswer: 6",
    "Question: What is the capital of France?\nAnswer: Paris",
    "Question: What colour is the sky on a clear day?\nAnswer: blue",
    "Question: How many legs does a spider have?\nAnswer: eight",
]


def engine(form: str) -> Engine:
    weights = form.removesuffix("+bf16")
    return Engine.load(
        EngineConfig(
            model="default",
            device="cpu",
            dtype="float32",
            cpu_weights=weights,
            cpu_prefill="bfloat16" if form.endswith("+bf16") else "float32",
            cpu_threads=1,
            max_num_seqs=4,
            max_model_len=LONG_TOKENS + 64,
            prefill_chunk_tokens=CHUNK,
        )
    )


def long_text() -> str:
    """English prose that ships with ballast: its modules' docstrings, in a fixed order."""
    root = Path(__file__).resolve().parent.parent
    docs = []
    for sub in ("models", "engine", "memory", "scheduler", "server"):
        for path in sorted((root / sub).glob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()))
            if doc:
                docs.append(doc)
    return "\n\n".join(docs)


def long_logprobs(eng: Engine, ids: list[int]) -> torch.Tensor:
    """Every token's logprob over ids prefilled in CHUNK-token steps (the next token's, from
    each position's logits)."""
    kv = eng.runner.kv
    assert kv is not None
    kv.release(0)
    assert kv.ensure(0, len(ids))
    chunks = range(0, len(ids), CHUNK)
    logits = torch.cat([forward(eng, 0, ids[s : s + CHUNK], s, every=True) for s in chunks])
    kv.release(0)
    return logits.log_softmax(-1)


def prefill_s(eng: Engine, ids: list[int]) -> float:
    """Wall seconds of the prompt's prefill in CHUNK-token steps (last logits only), best of 2."""
    kv = eng.runner.kv
    assert kv is not None
    best = float("inf")
    for _ in range(2):
        kv.release(0)
        assert kv.ensure(0, len(ids))
        t0 = time.perf_counter()
        for s in range(0, len(ids), CHUNK):
            forward(eng, 0, ids[s : s + CHUNK], s)
        best = min(best, time.perf_counter() - t0)
    kv.release(0)
    return best


def reference(dense: Engine) -> Any:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config: dict[str, Any] = {k: v for k, v in dense.hf_config.items() if k != "seed"}
    ref = HFLlama(LlamaConfig(**config)).eval()
    ref.load_state_dict(dense.runner.model.state_dict(), strict=False)
    ref.tie_weights()
    return ref


def parity_prompts() -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(123)
    lengths = {0: 4, 1: 13, 2: 1, 3: 29}
    return {s: torch.randint(3, 49152, (n,), generator=gen).tolist() for s, n in lengths.items()}


def forward(eng: Engine, slot: int, ids: list[int], start: int, every: bool = False) -> torch.Tensor:
    return eng.runner.forward([(slot, ids, start)], [every]).clone()


def teacher_forced(eng: Engine, slot: int, ids: list[int], forced: list[int]) -> torch.Tensor:
    kv = eng.runner.kv
    assert kv is not None
    kv.release(slot)
    assert kv.ensure(slot, len(ids) + len(forced))
    rows = [forward(eng, slot, ids, 0)[0]]
    rows += [forward(eng, slot, [t], len(ids) + i)[0] for i, t in enumerate(forced[:-1])]
    kv.release(slot)
    return torch.stack(rows)


def echo_logprobs(eng: Engine, ids: list[int]) -> torch.Tensor:
    kv = eng.runner.kv
    assert kv is not None
    kv.release(0)
    assert kv.ensure(0, len(ids))
    logp = forward(eng, 0, ids, 0, every=True).log_softmax(-1)
    kv.release(0)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def answer(eng: Engine) -> str:
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    return "".join(generate_stream(eng, ids, GREEDY, max_tokens=48))


def decode_step_ms(eng: Engine, steps: int) -> tuple[float, float]:
    """(wall, engine-thread CPU) median ms of a batch-1 decode step after a 50-token prompt."""
    prompt = tuple(range(100, 150))
    eng.step(StepPlan(release=(0,)))
    tok = eng.step(StepPlan(prefills=(PrefillChunk(0, prompt, 0, True),), sampling={0: GREEDY})).outputs[0]
    token, walls, cpus = tok.token_id, [], []
    for i in range(steps + 3):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = eng.step(StepPlan(decodes=(DecodeToken(0, token, len(prompt) + i),), sampling={0: GREEDY}))
        if i >= 3:  # warm-up steps left out
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
        token = out.outputs[0].token_id
    eng.step(StepPlan(release=(0,)))
    return 1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(1)
    dense = engine("dense")
    ref = reference(dense)
    prompts = parity_prompts()
    forced, ref_logits = {}, {}
    with torch.inference_mode():
        for s, ids in prompts.items():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
            forced[s] = out[0, len(ids) :].tolist()
            ref_logits[s] = ref(torch.tensor([ids + forced[s][:-1]])).logits[0, len(ids) - 1 :]
        echo_ids = [dense.tokenizer.encode(t) for t in ECHO]
        ref_echo = []
        for ids in echo_ids:
            logp = ref(torch.tensor([ids])).logits[0].log_softmax(-1)
            ref_echo.append(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
        long_ids = dense.tokenizer.encode(long_text())[:LONG_TOKENS]
        ref_long = ref(torch.tensor([long_ids])).logits[0].log_softmax(-1)
    targets = torch.tensor(long_ids[1:])[:, None]
    ref_long_lp = ref_long[:-1].gather(1, targets)[:, 0]
    rows = []
    load_before = os.getloadavg()[0]
    for form in args.forms:
        eng = dense if form == "dense" else engine(form)
        model = eng.runner.model
        assert isinstance(model, LlamaForCausalLM)
        worst, flips, steps = 0.0, 0, 0
        for s, ids in prompts.items():
            ours = teacher_forced(eng, s, ids, forced[s])
            worst = max(worst, float((ours - ref_logits[s]).abs().max()))
            flips += int((ours.argmax(-1) != ref_logits[s].argmax(-1)).sum())
            steps += ours.shape[0]
        pairs = zip(echo_ids, ref_echo, strict=True)
        nats = max(float((echo_logprobs(eng, ids) - r).abs().max()) for ids, r in pairs)
        text = answer(eng)
        long_lp = long_logprobs(eng, long_ids)
        long_d = (long_lp[:-1].gather(1, targets)[:, 0] - ref_long_lp).abs()
        long_flips = int((long_lp.argmax(-1) != ref_long.argmax(-1)).sum())
        wall, cpu = decode_step_ms(eng, args.steps)
        rows.append(
            {
                "form": form,
                "max_abs_d_logit": worst,
                "greedy_changed": flips,
                "steps": steps,
                "echo_max_abs_d_logprob_nats": nats,
                "paris": "Paris" in text,
                "answer": text,
                "long_prompt_tokens": len(long_ids),
                "long_max_abs_d_logprob_nats": float(long_d.max()),
                "long_mean_abs_d_logprob_nats": float(long_d.mean()),
                "long_next_token_changed": long_flips,
                "long_prefill_s": prefill_s(eng, long_ids),
                "decode_step_ms": wall,
                "decode_step_thread_cpu_ms": cpu,
                "weights_mb": weights_bytes(model) / 1e6,
            }
        )
        if eng is not dense:
            eng.shutdown()
    dense.shutdown()
    load_after = os.getloadavg()[0]
    print(
        f"default model, CPU weight forms against transformers on the float32 weights; 1 thread, "
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} -> {load_after:.1f}"
    )
    print(f"{'form':10s} {'max|dlogit|':>12s} {'greedy changed':>15s} {'echo nats':>10s} {'Paris':>6s} "
          f"{'step ms':>8s} {'thread ms':>10s} {'weights MB':>11s} {'long max / mean nats':>21s} "
          f"{'long changed':>13s} {'prefill s':>10s}")  # fmt: skip
    for r in rows:
        print(
            f"{r['form']:10s} {r['max_abs_d_logit']:>12.4f} {r['greedy_changed']:>9d} / {r['steps']:<3d} "
            f"{r['echo_max_abs_d_logprob_nats']:>10.5f} {str(r['paris']):>6s} {r['decode_step_ms']:>8.1f} "
            f"{r['decode_step_thread_cpu_ms']:>10.1f} {r['weights_mb']:>11.0f} "
            f"{r['long_max_abs_d_logprob_nats']:>12.4f} / {r['long_mean_abs_d_logprob_nats']:.5f} "
            f"{r['long_next_token_changed']:>6d} / {r['long_prompt_tokens']:<5d} {r['long_prefill_s']:>10.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"bench": "cpu_weight_tolerance", "torch": torch.__version__, "cpus": os.cpu_count(),
              "load_average_1m": [load_before, load_after], "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
