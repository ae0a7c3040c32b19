#!/usr/bin/env bash
# The CUDA/NCCL paths of felactl on a machine with a GPU, in one go; what BENCHMARKS.md's GPU
# section records came from this script.
#
#   OUT=/some/dir bash benchmarks/gpu_checks.sh
#
# Needs python3 with a CUDA build of torch and felactl's dependencies importable (PYTHONPATH or an
# install). Writes logs, cluster.yaml, model.yaml, plan.yaml and the launch summary under $OUT.
set -u -o pipefail
OUT=${OUT:?set OUT to a folder for the results}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
FELACTL="python3 -m felactl"
RUNS=$(mktemp -d)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

echo "== GPU tests (elastic on NCCL included: what needs two GPUs skips on one)"
rm -rf /tmp/felactl-gpu-tests
timeout ${TESTS_TIMEOUT:-360} python3 -m pytest -p no:cacheprovider -n 0 -rs -v --basetemp=/tmp/felactl-gpu-tests \
    tests/test_profile_gpu.py tests/test_worker_gpu.py tests/test_elastic_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
# the runs' logs and events, for a test that failed
tar czf "$OUT/gpu_test_runs.tgz" -C /tmp/felactl-gpu-tests . 2>/dev/null || true

suite() {  # the suite's single-process tests with CUDA visible (the whole suite outlasts a call)
    echo "== the single-process suite with CUDA visible (on an H200 at -n 12 it outran 140 s, 2026-11-27)"
    timeout ${SUITE_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -q -m "not multiprocess" -n ${SUITE_WORKERS:-12} \
        2>&1 | tail -25 | tee "$OUT/suite.log"
}
if [ "${QUICK:-0}" = 1 ]; then  # the GPU tests, then the suite
    suite
    exit 0
fi

echo "== felactl profile (auto: one slot per GPU)"
$FELACTL profile -o "$OUT/cluster.yaml" --json >"$OUT/profile.json" || echo "profile failed: $?"
cat "$OUT/cluster.yaml"

echo "== felactl profile --model gpt-mini on cuda"
MODEL_CONFIG=(--config depth=8 --config width=512 --config seq_len=256)
$FELACTL profile --model gpt-mini --device cuda "${MODEL_CONFIG[@]}" --batch-sizes 4,16,64 \
    -o "$OUT/model.yaml" || echo "model profile failed: $?"

echo "== felactl plan"
$FELACTL plan --cluster "$OUT/cluster.yaml" --model "$OUT/model.yaml" --global-batch 64 -o "$OUT/plan.yaml" \
    || echo "plan failed: $?"

echo "== felactl launch (NCCL, the plan's sync; then --sync bsp)"
$FELACTL launch "$OUT/plan.yaml" --steps 200 --runs-root "$RUNS" --run-id gpu --json >"$OUT/launch.json" \
    || echo "launch failed: $?"
cat "$OUT/launch.json"
$FELACTL launch "$OUT/plan.yaml" --sync bsp --steps 100 --runs-root "$RUNS" --run-id gpu-bsp --json \
    >"$OUT/launch-bsp.json" || echo "launch --sync bsp failed: $?"
for mode in wbsp sdpipe; do
    $FELACTL launch "$OUT/plan.yaml" --sync $mode --steps 50 --runs-root "$RUNS" --run-id gpu-$mode --json \
        >"$OUT/launch-$mode.json" 2>"$RUNS/launch-$mode.err" && echo "launch --sync $mode: ok" \
        || { echo "launch --sync $mode failed: $?"; tail -3 "$RUNS/launch-$mode.err"; grep -h Error "$RUNS"/gpu-$mode/logs/*; }
done
python3 - "$RUNS/gpu" "$OUT/plan.yaml" <<'EOF'
import json, sys, statistics, yaml
from pathlib import Path
run, plan = Path(sys.argv[1]), yaml.safe_load(Path(sys.argv[2]).read_text())
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
steps = [r["duration_s"] for r in sorted(rows, key=lambda r: r["step"]) if r["rank"] == 0][20:]  # skip warm-up
measured = statistics.median(steps) * 1000
predicted = plan["predicted"]["iteration_s"] * 1000
print(f"iteration: measured {measured:.2f} ms, predicted {predicted:.2f} ms, ratio {measured / predicted:.2f}")
EOF
grep -h "backend\|nccl\|cuda" "$RUNS"/gpu/logs/* | head -5

echo "== what a token costs on the GPU's host (cost.TOKEN_OVERHEAD_S)"
timeout ${TOKENS_TIMEOUT:-150} python3 benchmarks/bench_token_overhead.py "$OUT/plan.yaml" --micro-batches 4,16,64 \
    --steps 60 | tee "$OUT/token_overhead.md" || echo "token overhead failed: $?"

suite
