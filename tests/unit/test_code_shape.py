"""The shape of the code, read from the source: the layering of DESIGN.md and the limits the
execution wing was rebuilt to (issue 34). Each rule is read off the AST of every module, so a
change that breaks one fails here, naming the module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("memory", "models", "engine", "scheduler", "server")
# What each layer may import of ours: imports flow server -> scheduler -> engine -> models, and
# every layer may import memory, which imports none of them.
MAY_IMPORT = {
    "memory": {"memory"},
    "models": {"models", "memory"},
    "engine": {"engine", "models", "memory"},
    "scheduler": {"scheduler", "engine", "models", "memory"},
    "server": {"server", "scheduler", "engine", "models", "memory"},
}
# The rooms of engine/ and models/ and their floors: a module imports only modules of its own room
# or of rooms on lower floors (two rooms on one floor know nothing of each other). A package's
# top-level modules are placed by name: engine/'s vocabulary (the plan, the config, ...) sits under
# every room, its assembly (the Engine, start-up, `ballast generate`) over them.
FLOORS = {
    "engine.text": 0,
    "engine.vocabulary": 1,
    "engine.kv": 2,
    "engine.step": 2,
    "engine.graphs": 3,
    "engine.spec": 3,
    "engine.runner": 4,
    "engine.parallel": 5,
    "engine.assembly": 6,
    "models.vocabulary": 0,
    "models.kernels": 1,
    "models.layers": 2,
    "models.blocks": 3,
    "models.arch": 4,
    "models.weights": 5,
}
TOP_MODULES = {
    "engine.vocabulary": {"plan", "config", "faults", "injected_faults", "interface", "threads", "workspace"},
    "engine.assembly": {"engine", "startup", "generate"},
    "models.vocabulary": {"base", "kv_store", "cache_dir"},
}
MAX_MODULE_LINES = 400  # every module of the five packages, kernel files (models/kernels/) aside
MAX_CLASS_LINES = 300  # engine/, scheduler/, models/ (kernel files aside)
MAX_ENGINE_IMPORTS = 8  # engine modules that engine/engine.py imports
# Lines of every module of engine/, models/ and scheduler/: the wing was rebuilt to fewer lines than
# the 17,445 it had before (97353a0), and a feature that lands there pays for itself or is written
# down here with what it bought.
MAX_WING_LINES = (
    17_445  # issue 34's rebuild
    + 120  # issue 46: eleven rooms' docstrings, gated DeltaNet's config protocol, split modules' imports
    # issue 48: the FP8 x FP8 expert GEMMs (the 80B's expert layer at 1,024 / 8,192 prompt tokens
    # 1,632 -> 564 / 5,132 -> 1,530 us; an 8k prompt 433 -> 317 ms, 32k 1.94 -> 1.34 s) and the
    # prompt budget beside decodes from measured step times (--max-itl-ms)
    + 270
    # issue 47: the queue played forward on measured step costs (a 2 GiB CPU cgroup's 46 refusals
    # at 0.75 s p99 instead of 45 at 30.5 s), /ready from the wait, a load that fits its container
    # (16 x 8k in 3 GiB starts instead of being refused), device_hang
    + 552
    # issue 47, s25: each load-estimate term on the path that runs (engine/runner/activations.py:
    # no float32 scores the CPU's flash path never holds; the pool's whole segments; a GGUF's load
    # staging): the default model at 16 x 8k estimated 788 against a measured 832 MiB, not 1,784
    + 80
    + 600  # issue 49: speculative decoding (engine/spec: config, prompt lookup, the verdict, rollback,
    # the governor; verify rows in the executor, the batch, the planner and the block kernel's step)
    # issue 47, session 25: step costs as the middle half of their last samples, not a running mean
    # (one descheduled 3.4 s step made four chats a 39 s projected wait and a 429)
    + 20
    # issue 48, session 25: start-up runs one step of every size class and kind a served step meets
    # (engine/runner/warm_up.py, the MoE block's thresholds): no Triton compile after /ready (the
    # 80B's first request of a new length waited 1.5-2.1 s; `run_on_device.sh flagship` measures it)
    + 197
    # issue 49, MTP: Qwen3-Next's multi-token-prediction layer loaded (HF checkpoints, random for
    # built-ins) and drafting from the target's hidden states with its KV in the slot's blocks
    + 383  # (3 of them where it meets issue 48's warm-up in start-up)
    + 40  # issue 49: the draft length follows the acceptance by position (governor)
    # issue 47, s25b: the load estimate's measured tokenizer and code terms, the heap handed back
    # after the load (16 x 8k: 853 estimated against 809-839 MiB measured, was 788 against 872); a size
    # class's first step stands in until a warm one is measured (a CPU burst's 22 refusals at
    # arrival, 0.30 s p50, not at the bound's end, 2.4 s)
    + 46
    # issue 49, s25: each sequence's acceptance checked for free (its proposal against the tokens
    # that come, drafting or not) against the measured cost of a drafted position: a copy served
    # after a story drafts within 3 steps (it waited out a 24-384-step verdict), and a story and a
    # copy in one batch each draft their own length; prompt lookup searched as bytes (4k tokens
    # 1.3 ms -> 0.24 ms), as every decoding sequence now gets a proposal checked after each step;
    # step costs as medians of the last 9 (a spike kept by a running average stopped drafting)
    + 66
    # issue 47, s26: the step in flight bounds the unmeasured step costs from below (requests queued
    # before a fresh server's first step came back: refused at 0.46 s p50 / 0.79 s max, not each at
    # the end of its 2 s bound), and nothing is projected to start before it ends (a request that
    # came during a 2.8 s prefill step was projected at 1.7 s and served at 4.3 s)
    + 64
    # issue 47, s26: a GPU load estimate counts the step workspace start-up leases on the die (the
    # 8B at 128 slots: 552 MiB it left out; its estimate read 0.66 of the H100's peak)
    + 18
    # issue 47, s29: warm-up's steps largest first (ascending, the caching allocator kept every size
    # class's segments: ~940 MiB on the 8B against a 232 MiB chunk) and a full batch drawn at start
    # (the sampler's leased workspace held from the start, not at the first full batch)
    + 20
    # issue 47, s26: the refusals no prompt changes come before the prompt is built (a full queue
    # on this CPU, 64 clients x 3 chats of 2.7k tokens: client p50 / p99 0.17 / 0.88-1.02 s ->
    # 0.05 / 0.25-0.34 s, the server's own 25 ms -> 0.3 ms); the wait projected for the least
    # request (one token) past the bound is such a refusal too
    + 29
    + 26
    # s26: a refusal at arrival names the share of the bound it was held to ("estimated wait 21.5 s
    # > max queue wait 30 s" read as a contradiction; it was held to 0.7 of it)
    + 13
    # issue 47, s27: at TIGHT the KV pools keep their working set of the last --kv-keep-s (s26's
    # H100 squeeze gave the 1 GiB its warm-up had used back while idle and then served 3 of a
    # burst's 192; on the CPU requests after a lull went to int8 blocks); a model's weights
    # allocated once (fusing after to_empty freed 8.5 GiB of the 8B's q/k/v/gate/up into the
    # caching allocator); the ladder's narrower window only for requests that need new memory
    # (152 of the squeeze's 192 refused for it beside a kept working set); less the prompt budget
    # read from the step costs (-23)
    + 51
    # issue 47, s28: a request the main pool takes whole once running ones end waits for its
    # blocks rather than start cut short in (or be refused by) an int8 pool that cannot take it
    # (184 of the H100 squeeze's 192 refused); the working set kept against the blocks sequences
    # hold, not a step-old figure that gave it all back when its last requests ended together
    + 9
    # issue 49, s28: a hybrid's rejected drafts rolled back to the state its verify step kept after
    # the last accepted token (a verify row runs the rule token by token, in torch and in the Triton
    # decode kernel, into a workspace sized at load and leased with the slot states), in place of
    # restoring a copy and running a second forward over the accepted tokens (start-up's warm-up
    # runs a verify step so its kernel variant compiles before /ready; the load's fit counts the
    # workspace); the rule's torch and fla forms moved to models/blocks/delta_rule.py to keep
    # gated_delta.py under 400 lines
    + 294
    # issue 49, s29: verify steps (every row a decode and its drafts: one row at any draft length,
    # more rows at k) replayed as CUDA graphs, captured at start where the engine drafts and leased
    # (cuda-graphs-verify): the aim's k=3 verify step of the 6.2B took 113-128 ms eagerly (with s26's
    # second forward), against a 5.1 ms decode graph (H100); its replayed figure: `run_on_device.sh spec`
    + 312
    # issue 49, s29: a plain greedy row's verdicts in one copy to the host, not a draw and a wait a
    # position (one k=4 verdict on the CPU, vocab 49,152: 1.21 -> 0.52 ms; on a GPU 4 syncs -> 1)
    + 39
    # issue 49, s30: an MTP step of more emitting streams than draft (from max_streams on) writes
    # the layer's KV and proposes nothing: no k heads and k - 1 eager passes a step for no drafts
    # (the queue-wait blame of s30 came in at -1, so +5 here)
    + 5
    # issue 49, s29: MTP with decode and verify CUDA graphs (each replay hands back the hidden states
    # the drafter reads, `graphs.decode.Leftover`): with mtp on, every decode step was eager (the
    # 80B's eager k=3 verify step 77.6 ms against a 5.49 ms replayed decode step, H100)
    + 79
    # issue 47, s31: the queue-wait projection read times its measured error, the median of queued
    # requests' real over projected waits (scheduler/service_rate.py WaitAccuracy): the H100
    # squeeze refused at arrival on waits projected 8.7 s or more past the first token of the last
    # request served ahead; the fake engine's bursts measure 1.15-1.24, and a burst read at 0.7
    # queues ~1.45x the requests before its first refusal (tests/unit/test_scheduler_faults.py); and
    # /ready's turn for the wait logs once what the projection stood on (running, queued, free KV
    # blocks, step costs, the factor): the squeeze's log could not say which term ran long
    + 71
    # issue 47, s32: that factor reads a new request's projection only, and is measured on waits
    # projected at 0.35 of the bound or more (read everywhere, it refused 8 of 136 let-in requests
    # after 1-5 s when it rose under a standing queue, and served 56 of 192 on an H100 squeeze; now
    # 140-146); each queued request's first token against its projection as a request event (the
    # squeeze's table of the projection's error by projected wait; its fields in JSON logs)
    + 16
)


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {
        _name(path): ast.parse(path.read_text(), filename=str(path))
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
    }


def _ours(tree: ast.Module) -> set[str]:
    """Our modules a module names in an import, at any depth of the file: function-level imports
    run all the same, and an import for annotations alone (`if TYPE_CHECKING:`) is knowledge of the
    other module all the same."""
    found: set[str] = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "ballast" and len(parts) >= 2 and parts[1] in PACKAGES:
                found.add(".".join(parts[1:]))
    return found


MODULES = _modules()
IMPORTS = {name: {m for m in _ours(tree) if m in MODULES and m != name} for name, tree in MODULES.items()}


def room(module: str) -> str | None:
    """The room a module of engine/ or models/ lives in (None: another package's module)."""
    parts = module.split(".")
    if parts[0] not in ("engine", "models"):
        return None
    if len(parts) > 2 or (len(parts) == 2 and f"{parts[0]}.{parts[1]}" in FLOORS):
        return f"{parts[0]}.{parts[1]}"
    for name, members in TOP_MODULES.items():
        if name.startswith(parts[0] + ".") and (len(parts) == 1 or parts[1] in members):
            return name
    return f"{module} (not placed)"


def test_every_layer_imports_only_the_layers_below_it() -> None:
    wrong = sorted(
        f"{name} imports {dep}"
        for name, deps in IMPORTS.items()
        for dep in deps
        if dep.split(".")[0] not in MAY_IMPORT[name.split(".")[0]]
    )
    assert not wrong, wrong


def test_every_module_of_engine_and_models_has_a_room() -> None:
    unplaced = sorted(r for r in map(room, MODULES) if r is not None and r not in FLOORS)
    assert not unplaced, unplaced


def test_every_room_imports_only_from_rooms_below_it() -> None:
    wrong = sorted(
        f"{name} ({room(name)}) imports {dep} ({room(dep)})"
        for name, deps in IMPORTS.items()
        if room(name) in FLOORS
        for dep in deps
        if dep.split(".")[0] == name.split(".")[0]
        and room(dep) in FLOORS
        and room(dep) != room(name)
        and FLOORS[room(dep)] >= FLOORS[room(name)]  # type: ignore[index]
    )
    assert not wrong, wrong


def test_no_module_imports_itself_back_through_others() -> None:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(IMPORTS[name]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(IMPORTS):
        if name not in state:
            visit(name, [name])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_no_module_is_over_400_lines() -> None:
    big = sorted(
        f"{path.relative_to(ROOT)}: {n} lines"
        for pkg in PACKAGES
        for path in (ROOT / pkg).rglob("*.py")
        if "kernels" not in path.parts and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert not big, big


def test_no_class_in_the_execution_wing_is_over_300_lines() -> None:
    big = sorted(
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in MODULES.items()
        if name.split(".")[0] in ("engine", "scheduler", "models") and ".kernels." not in name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    )
    assert not big, big


def test_the_execution_wing_has_fewer_lines_than_before_its_rebuild() -> None:
    sizes = {
        p: len(p.read_text().splitlines())
        for pkg in ("engine", "models", "scheduler")
        for p in (ROOT / pkg).rglob("*.py")
    }
    largest = sorted(sizes, key=sizes.__getitem__)[-3:]
    assert sum(sizes.values()) <= MAX_WING_LINES, [f"{p.relative_to(ROOT)}: {sizes[p]}" for p in largest]


def test_the_engine_module_imports_few_engine_modules() -> None:
    engine_deps = sorted(m for m in IMPORTS["engine.engine"] if m.startswith("engine."))
    assert len(engine_deps) <= MAX_ENGINE_IMPORTS, engine_deps


# A decode row fed from the device (its token is the slot's previous sample, not yet on the host):
# the successor of LAST_SAMPLED, named by these (`ahead` as `DecodeToken.ahead`). The runner, the
# graphs and the models know only the batch's neutral `fill_tokens`.
DEVICE_FED_NAMES = {"LAST_SAMPLED", "from_device"}
DEVICE_FED_ATTRIBUTES = {"ahead"}
# The step's KV-format flag (a sequence of the batch lives in the int8 store): marked where the
# KV manager answers, read by attention's backend. The plan's per-sequence `int8_kv` (the ladder's
# choice for a new sequence) is the sequence's property, not this flag.
INT8_BATCH_FLAG = {"uses_int8_kv"}
MAX_FILES_NAMING = 3


def _files_naming(
    names: set[str], packages: tuple[str, ...], attributes: frozenset[str] = frozenset()
) -> list[str]:
    """Modules of these packages whose code names any of `names` (a variable, attribute, argument,
    keyword, function or import; comments and docstrings aside) or reads any of `attributes`."""
    found = set()
    for module, tree in MODULES.items():
        if module.split(".")[0] not in packages:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                idents = [node.id]
            elif isinstance(node, ast.Attribute):
                idents = [node.attr]
                if node.attr in attributes:
                    found.add(module)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                idents = [node.name]
            elif isinstance(node, ast.arg):
                idents = [node.arg]
            elif isinstance(node, ast.keyword):
                idents = [node.arg or ""]
            elif isinstance(node, ast.ImportFrom):
                idents = [a.name for a in node.names]
            else:
                continue
            if names.intersection(idents):
                found.add(module)
    return sorted(found)


def test_decodes_fed_from_the_device_are_known_to_three_files_at_most() -> None:
    files = _files_naming(
        DEVICE_FED_NAMES, ("engine", "models", "scheduler"), frozenset(DEVICE_FED_ATTRIBUTES)
    )
    assert len(files) <= MAX_FILES_NAMING, files
    assert not [f for f in files if f.startswith("models.")], files


def test_the_int8_batch_flag_is_named_in_three_files_at_most() -> None:
    files = _files_naming(INT8_BATCH_FLAG, ("engine", "models", "scheduler"))
    assert "models.base" in files and len(files) <= MAX_FILES_NAMING, files
    # the plan's per-sequence choice is read where a new sequence is placed, and nowhere else
    assert _files_naming({"int8_kv"}, ("engine", "models")) == ["engine.plan", "engine.runner.executor"]
