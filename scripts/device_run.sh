#!/usr/bin/env bash
# On a lent GPU machine (the `device` tool; its image has torch, triton, transformers, aiohttp,
# prometheus-client, but not msgspec): install the carried msgspec wheel, map the package's
# sub-packages as the editable install would, build the grown pair (benchmarks/pair.py grow)
# into build/grown unless it is there, then run the stages named as arguments.
#   bash scripts/device_run.sh smoke grow kernels bench pair exact profile graphs sweep engine replay
# pair: PAIR_SETTINGS, PAIR_BATCH, PAIR_ROUNDS override the defaults.
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
for d in kernels drafts server; do [ -e specserve/$d ] || ln -s ../$d specserve/$d; done
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python -m specserve.cli "$@"\n' >/tmp/bin/specserve && chmod +x /tmp/bin/specserve
export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/site:$PWD
G=build/grown
grow() {
  [ -f $G/target/model.safetensors ] || python -m benchmarks.pair grow --src embedded:tiny-target --shape llama3-8b --out $G/target
  [ -f $G/draft/model.safetensors ] || python -m benchmarks.pair grow --src embedded:tiny-draft --shape llama3.2-1b --out $G/draft
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    smoke) nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm,power.limit --format=csv
           python -c "import torch, triton, transformers, msgspec; print(torch.__version__, triton.__version__, transformers.__version__, msgspec.__version__)";;
    grow) grow 2>&1 | grep -v '  layer' | tee $OUT/grow.log;;
    kernels) timeout 240 python -m pytest -q -x -p no:cacheprovider tests/kernels 2>&1 | tail -25 | tee $OUT/kernels.log;;
    bench) timeout 150 python benchmarks/bench_kernels.py --dtype bfloat16 2>&1 | tee $OUT/bench_kernels.log;;
    pair) grow >/dev/null 2>&1; timeout ${PAIR_TIMEOUT:-240} python -m benchmarks.pair speed --target $G/target --draft $G/draft \
            --batch ${PAIR_BATCH:-1 16 64} --rounds ${PAIR_ROUNDS:-1} ${PAIR_SETTINGS:+--settings $PAIR_SETTINGS} --out $OUT/pair_speed.json 2>&1 | grep -v Warning | tee $OUT/pair_speed.log;;
    exact) for dt in float32 bfloat16; do
             timeout 150 python -m benchmarks.pair speed --target specserve/assets/tiny-target --draft specserve/assets/tiny-draft \
               --dtype $dt --batch 1 16 --rounds 1 --settings static0 static1 static3 adaptive 2>&1 | grep -v Warning | tail -9 | tee -a $OUT/exact.log
           done;;
    profile) grow >/dev/null 2>&1
           timeout 150 python -m benchmarks.profile_step --target $G/target --batch 1 --rows 30 2>&1 | grep -v Warning | tee $OUT/profile_plain.log | head -50
           [ -n "${PROFILE_SPEC:-}" ] && timeout 150 python -m benchmarks.profile_step --target $G/target --draft $G/draft --setting static3 --batch 1 --rows 30 2>&1 | grep -v Warning | tee $OUT/profile_static3.log | head -50;;
    sweep) grow >/dev/null 2>&1
           printf '[target]\npath = "target"\ndtype = "bfloat16"\n\n[draft]\nkind = "model"\npath = "draft"\ndtype = "bfloat16"\n\n[spec]\nmode = "adaptive"\nmax_depth = 8\n\n[cache]\nnum_blocks = 4096\n\n[server]\nserved_model_name = "grown-8b"\n' > $G/pair.toml
           # SWEEP_GRAPHS=1: serve with cuda_graphs (a top-level key, so it goes before the tables)
           [ -n "${SWEEP_GRAPHS:-}" ] && sed -i '1i cuda_graphs = true\n' $G/pair.toml
           rm -rf /tmp/sweep
           timeout ${SWEEP_TIMEOUT:-420} python -m benchmarks.sweep --config $G/pair.toml --rounds 1 \
             --prompts-per-concurrency 2 --min-prompts 8 --concurrency ${SWEEP_CONC:-1 4 16 64} --settings ${SWEEP_SETTINGS:-adaptive none static1 static2 static3 static4} \
             --out-dir /tmp/sweep -- --max-tokens 48 --prompts-file benchmarks/data/heldout_prompts.jsonl --no-progress 2>&1 | grep -v Warning | tail -40
           tar czf $OUT/sweep.tgz -C /tmp sweep;;
    replay) timeout 100 python -m benchmarks.replay judge 2>&1 | tee $OUT/replay.log;;
    graphs) grow >/dev/null 2>&1   # CUDA graphs: the capture test, then the pair with and without them
           timeout 200 python -m pytest -q -x -p no:cacheprovider tests/engine/test_graphs.py 2>&1 | tail -5 | tee $OUT/graphs_test.log
           timeout 150 python -m benchmarks.profile_step --target $G/target --batch 1 --rows 15 --cuda-graphs 2>&1 | grep -v Warning | tee $OUT/profile_graphs.log | head -25
           timeout 300 python -m benchmarks.pair speed --target $G/target --draft $G/draft --batch 1 16 64 --rounds 1 --cuda-graphs \
             --out $OUT/pair_speed_graphs.json 2>&1 | grep -v Warning | tail -25 | tee $OUT/pair_speed_graphs.log;;
    engine) timeout ${ENGINE_TIMEOUT:-200} python -m pytest -q -x -p no:cacheprovider tests/engine/test_generate.py tests/engine/test_spec.py tests/engine/test_lossless.py 2>&1 | tail -25 | tee $OUT/engine.log;;
    *) echo "unknown stage $stage";;
  esac
done
echo "=== done $(date +%T)"
