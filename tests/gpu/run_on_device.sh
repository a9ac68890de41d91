#!/usr/bin/env bash
# How this session's GPU checks run on the lent H200 (see /work/.library/device): the wheels the
# image lacks come from .whl (../shared/tools/gpu-wheels.sh), the Triton cache stays in /tmp while
# the machine is warm. Usage: tests/gpu/run_on_device.sh squeeze|hang-fit|fit|suite-a|suite-b|suite-c|spec [pytest args]
#   (suite-a, -b, -c: the test files in three contiguous thirds, each well inside one call's 600 s)
#   tests/gpu/run_on_device.sh compare BASE profile|paged|serve|spec: one bench on the package root BASE
#   (another commit: mkdir BASE && git archive COMMIT | tar -x -C BASE), then on this tree, in one
#   call; each side's JSON under $OUT as BENCH_base.json / BENCH_new.json (PROFILE_MODELS: the
#   profile's models, default llama-8b qwen3-next-6b)
#   tests/gpu/run_on_device.sh flagship [bench/flagship args]: issue 48's aims table on the 80B FP8
#   (one server start: first request after /ready, 1 / 10 (1,024 new) / 32 / 128 streams; then the
#   engine's prefill with the FP8 x FP8 experts off and on, then --max-itl-ms 60 at 32 / 128 streams,
#   each only where its time is left before the deadline): the start ~200-300 s on a cold Triton cache
#   (start-up's warm-up included), the rows ~70 s, the A/B ~90 s, the budgeted start ~150 s; <= 545 s
#   tests/gpu/run_on_device.sh flagship-6b: the 6.2B cut (qwen3-next-6b) at 128 streams, ~150 s
#   tests/gpu/run_on_device.sh moe-decode: the 80B's FP8 expert layer at 32 / 64 / 128 tokens, the
#   fused kernels (their tilings swept at 32) and the FP8 x FP8 experts at each tiling, ~4 min
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 3; }
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
# The `ballast` import package as pyproject's package-dir maps it, in place (the source tree's
# own ballast/ folder is first on sys.path from the root, so the subpackages are linked into it)
for d in memory models engine scheduler server bench; do ln -sfn ../$d ballast/$d; done
export PYTHONPATH=/tmp/site:$PWD
out=${OUT:-/tmp/out}
mode=$1; shift
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
case "$mode" in
  squeeze)  # issue 47's scenario: the 8B shape at 128 slots, warmed at 8 streams; a co-tenant takes
    # all but ~200 MiB and holds; 64 streaming clients send 192 requests of ~1k-token prompts, three
    # times (a later burst is projected with the factor the queued requests before it measured; the
    # server's debug log gives each queued request's first token against its projection, by bin).
    # Prints the p99 time to a 429/503 at the server and the client, completed against refused, the
    # served TTFT p99 and OOM lines; JSON in $OUT/squeeze_8b.json, the server's log beside it. ~240 s.
    tok=/tmp/tok; mkdir -p $tok
    python3 -c "from ballast.bench.checkpoint_dir import write_tokenizer; from pathlib import Path; write_tokenizer(Path('$tok'))"
    (cd tests/reliability && timeout ${SQUEEZE_S:-270} python3 vram_squeeze.py --model builtin:llama-8b --mode on \
      --streams 128 --warm-streams 8 --clients 64 --burst 192 --bursts 3 --prompt-words 260 --max-tokens 128 --deadline-s 90 \
      --serve-arg=--log-level --serve-arg=debug \
      --serve-arg=--tokenizer --serve-arg=$tok --out $out/squeeze_8b.json 2>&1 | tail -72)
    grep "not ready for the queue wait" $out/squeeze_8b.log | head -4  # what the projection stood on
    ;;
  hang-fit)  # issue 47: a kernel that spins on the device (the watchdog, 503s, exit); the load
    # estimate against the peak after one max-length sequence, on the 8B shape
    timeout ${HANG_S:-75} python3 -m pytest -x -q -s -p no:cacheprovider -o addopts="" tests/gpu/test_device_hang_cuda.py 2>&1 | tail -12
    ;&
  fit)  # the load estimate against the peak only (~2 min)
    tok=/tmp/tok; mkdir -p $tok
    python3 -c "from ballast.bench.checkpoint_dir import write_tokenizer; from pathlib import Path; write_tokenizer(Path('$tok'))"
    timeout ${FIT_S:-170} python3 -m ballast.bench.load_fit --model builtin:llama-8b --device cuda --case 128x4096 --segments \
      --tokenizer $tok --out $out/load_fit_8b.json 2>&1 | tail -30
    ;;
  flagship)  # issue 48 (bench/flagship.py): JSON and the servers' logs under $OUT
    timeout ${FLAGSHIP_S:-545} python3 -m ballast.bench.flagship --deadline-s ${DEADLINE_S:-530} \
      --out $out/flagship.json "$@" 2>&1 | tail -${TAIL:-45}
    ;;
  flagship-6b)
    timeout ${FLAGSHIP_S:-300} python3 -m ballast.bench.flagship --model builtin:qwen3-next-6b --rows first 128 \
      --prefill-lengths --budget-rows 128 --deadline-s ${DEADLINE_S:-280} --out $out/flagship_6b.json "$@" 2>&1 \
      | tail -${TAIL:-30}
    ;;
  moe-decode)  # issue 48: which expert path and tiling serve 32-128 decode tokens (bench/moe_experts.py)
    timeout ${MOE_S:-420} python3 -m ballast.bench.moe_experts --shapes qwen3-next-80b --fp8 --tokens 32 64 128 \
      --w8a8-sweep --sweep --sweep-tokens 32 --repeats 6 --out $out/moe_decode.json "$@" 2>&1 | tail -${TAIL:-30}
    ;;
  suite-a|suite-b|suite-c)
    files=$(ls tests/gpu/test_*.py | sort)
    n=$(echo "$files" | wc -l); third=$(( (n + 2) / 3 ))
    k=$(( $(printf %d "'${mode#suite-}") - 97 ))
    sel=$(echo "$files" | tail -n +$((k * third + 1)) | head -n $third)
    python3 -m pytest -v -rfE -p no:cacheprovider --durations=15 -o addopts="" $sel "$@" 2>&1 | tee $out/$mode.log | tail -40
    ;;
  spec)  # issue 49: the verify and MTP graphs' tests (s29: a replayed verify step against the eager one, tiny
    # models, ~40 s on a warm Triton cache), the spec-decode GPU tests (the 6.2B's greedy parity with
    # drafts among them; the Triton kernel's verify rows keeping their per-position states, s28), then
    # the oracle-drafter bench (bench/spec_oracle.py: verify graphs captured and replayed, verify step
    # over decode step) on the 6.2B and on the 80B FP8, each in its own process and file, so a cold 80B load cut by its
    # timeout keeps the 6.2B's row; <= 520 s without the 80B (SPEC_80B_S=0: the 80B in a call of its own)
    # each part's time limit (seconds) in SPEC_GRAPHS_S, SPEC_MTP_S, SPEC_TEST_S, SPEC_6B_S, SPEC_80B_S; 0 skips it
    [ "${SPEC_GRAPHS_S:-120}" = 0 ] || timeout ${SPEC_GRAPHS_S:-120} python3 -m pytest -v -rfE -p no:cacheprovider --durations=5 -o addopts="" \
      tests/gpu/test_verify_graphs_cuda.py 2>&1 | tee $out/verify_graphs_tests.log | tail -16
    # MTP with decode and verify graphs (s29): replays hand back the drafter's hidden states, drafts
    # and greedy text as the eager engine's; tiny-qwen3-next, two engines, ~30-60 s
    [ "${SPEC_MTP_S:-120}" = 0 ] || timeout ${SPEC_MTP_S:-120} python3 -m pytest -v -rfE -s -p no:cacheprovider --durations=5 -o addopts="" \
      tests/gpu/test_mtp_graphs_cuda.py 2>&1 | tee $out/mtp_graphs_tests.log | tail -20
    [ "${SPEC_TEST_S:-120}" = 0 ] || timeout ${SPEC_TEST_S:-120} python3 -m pytest -v -rfE -p no:cacheprovider --durations=8 -o addopts="" \
      tests/gpu/test_spec_decode_cuda.py \
      tests/gpu/test_gated_delta_decode_cuda.py::test_verify_rows_keep_the_state_after_each_position \
      tests/gpu/test_gated_delta_decode_cuda.py::test_a_verify_row_through_the_model_keeps_what_decode_steps_reach \
      2>&1 | tee $out/spec_tests.log | tail -24
    # the 6.2B in float32: in bf16 its first verify step parted from the oracle's text (a tie of
    # random weights) and every draft after it was rejected (s26, H100); on a cold Triton cache it
    # did not finish in 90 s (s29, H100)
    [ "${SPEC_6B_S:-160}" = 0 ] || timeout ${SPEC_6B_S:-160} python3 -m ballast.bench.spec_oracle --models qwen3-next-6b --dtype float32 \
      --out $out/spec_oracle_qwen3-next-6b.json 2>&1 | tail -5
    [ "${SPEC_80B_S:-200}" = 0 ] || timeout ${SPEC_80B_S:-200} python3 -m ballast.bench.spec_oracle \
      --models qwen3-next-80b-a3b-fp8 --out $out/spec_oracle_qwen3-next-80b-a3b-fp8.json 2>&1 | tail -5
    ;;
  compare)
    base=$1; what=$2; shift 2
    for d in memory models engine scheduler server bench; do ln -sfn ../$d $base/ballast/$d; done
    for name in base new; do  # each side from its own tree (the cwd is first on sys.path)
      dir=$PWD; [ $name = base ] && dir=$PWD/$base
      case "$what" in
        profile) set -- decode_profile --models ${PROFILE_MODELS:-llama-8b qwen3-next-6b} --batch 1 32 --no-eager ;;
        paged) set -- paged_decode --quick --models llama-8b qwen3-next --no-reference ;;
        serve) set -- gpu_serve --quick --shape llama-3b --reference none --no-engine-rate ;;
        spec) set -- spec_oracle --models qwen3-next-6b --dtype float32 ;;  # s28: the rollback's A/B
      esac
      echo "== $1 $name"
      (cd $dir && PYTHONPATH=/tmp/site:$dir timeout ${SIDE_S:-280} python3 -m ballast.bench."$@" --out $out/$1_$name.json 2>&1 | tail -${TAIL:-14})
    done
    ;;
esac
