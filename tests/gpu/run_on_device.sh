#!/usr/bin/env bash
# How this session's GPU checks run on the lent H200 (see /work/.library/device): the wheels the
# image lacks come from .whl (../shared/tools/gpu-wheels.sh), the Triton cache stays in /tmp while
# the machine is warm. Usage: tests/gpu/run_on_device.sh squeeze|suite-a|suite-b [pytest args]
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
  squeeze)
    tok=/tmp/tok; mkdir -p $tok
    python3 -c "from ballast.bench.checkpoint_dir import write_tokenizer; from pathlib import Path; write_tokenizer(Path('$tok'))"
    (cd tests/reliability && timeout 150 python3 vram_squeeze.py --model builtin:llama-1b --mode on \
      --streams 32 --clients 64 --prompt-words 300 --max-tokens 256 --hog-s 20 --hold-s 25 --serve-arg=--max-model-len --serve-arg=4096 \
      --serve-arg=--tokenizer --serve-arg=$tok --out $out/vram_squeeze_on.json 2>&1 | tail -25)
    ;;
  suite-a|suite-b)
    files=$(ls tests/gpu/test_*.py | sort)
    n=$(echo "$files" | wc -l); half=$(( (n + 1) / 2 ))
    if [ "$mode" = suite-a ]; then sel=$(echo "$files" | head -n $half); else sel=$(echo "$files" | tail -n +$((half + 1))); fi
    python3 -m pytest -v -rfE -p no:cacheprovider --durations=15 -o addopts="" $sel "$@" 2>&1 | tee $out/$mode.log | tail -40
    ;;
esac
