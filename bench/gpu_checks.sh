#!/usr/bin/env bash
# Every GPU check of one lent-machine session, in one command (docs/gpu.md):
#   1. what the machine is (GPU, driver, CUDA, torch, Lightning, transformers, TE if any);
#   2. the CUDA tests: CUDA-graph capture and replay, CUDA RNG streams, real-TE layers (skipped
#      without TE), and the tutorial module on 2-4 ranks sharing the GPU over gloo against DDP;
#   3. bench/bench_gpu.py on the BERT-large shape (the configurations in $GPU_CONFIGS).
# Results go to $OUT (the device tool's output folder) or bench/results/gpu.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
CONFIGS=${GPU_CONFIGS:-L-torch,L-default,D-hf,L-torch+graphs,D-plan,D-hf+graphs}

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, lightning, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'lightning', lightning.__version__, 'transformers', transformers.__version__)"
  python3 -c "import transformer_engine; print('transformer_engine', transformer_engine.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -rs -p no:cacheprovider --timeout 200 \
  tests/pipeline/test_cuda_ranks.py tests/cuda_graphs tests/layers/test_random.py tests/layers/test_te_backend.py \
  > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest_gpu.txt"
tail -25 "$OUT/pytest_gpu.txt"

timeout "${BENCH_SECONDS:-300}" python3 bench/bench_gpu.py --configs "$CONFIGS" --timeout 120 --out-dir "$OUT" ${BENCH_ARGS:-} \
  > "$OUT/bench_gpu.txt" 2>&1
echo "bench exit $?" >> "$OUT/bench_gpu.txt"
grep -v "^\s*$" "$OUT/bench_gpu.txt" | tail -40
