#!/usr/bin/env bash
# The simulator's checks that need a CUDA GPU, as one script (under 10 minutes on one GPU;
# each part has its own time limit, T_TESTS, T_KERNELS, T_PROFILE, T_FIDELITY seconds):
#   1. the torch and cost-model tests on CPU and CUDA;
#   2. benchmarks/gpu_kernel_check.py: this GPU's GEMMs and attention against the curve the
#      simulator uses for its preset (--gpu, default h200: derived from specs, not fitted);
#   3. kvloop profile on CUDA of a model with MODEL_SRC's shapes and random weights;
#   4. benchmarks/sim_fidelity.py on CUDA with that calibration.
# Usage: benchmarks/sim_gpu_check.sh MODEL_SRC [GPU_PRESET]
#   MODEL_SRC: a folder with a Hugging Face config.json (and tokenizer files), e.g. a copy of
#   the default model's converted folder without its weights. Results go to $OUT (default
#   ./gpu-check-out). PYTHON picks the interpreter (default python3); kvloop runs from src/.
set -uo pipefail
src=${1:?usage: benchmarks/sim_gpu_check.sh MODEL_SRC [GPU_PRESET]}
gpu=${2:-h200}
device=${DEVICE:-cuda}
. "$(dirname "$0")/gpu_common.sh"
model=$(mktemp -d)/model

step "random-weight model from $src"
$py benchmarks/random_model.py "$src" "$model" --dtype bfloat16 || exit 1

step "tests: torch executor and cost model, CPU and CUDA"
timeout ${T_TESTS:-100} $py -m pytest -q -p no:cacheprovider tests/torch tests/executor 2>&1 | tail -15 | tee "$out/pytest.txt"

step "kernel curves on this GPU vs the '$gpu' preset"
timeout ${T_KERNELS:-90} $py benchmarks/gpu_kernel_check.py --gpu "$gpu" --json "$out/kernels.json" 2>&1 | tee "$out/kernels.txt"

step "kvloop profile on $device"
timeout ${T_PROFILE:-150} $py -m kvloop.cli profile --model "$model" --device "$device" --no-progress \
    -o "$out/calibration.json" 2>&1 | tee "$out/profile.txt"

step "self-validation on $device"
timeout ${T_FIDELITY:-200} $py benchmarks/sim_fidelity.py --model "$model" --device "$device" \
    --calibration "$out/calibration.json" --num-requests "${NUM_REQUESTS:-200}" \
    --request-rate "${REQUEST_RATE:-8}" --scale "${SCALE:-0.5}" \
    --max-num-seqs 128 --max-num-batched-tokens 2048 \
    --json "$out/fidelity.json" 2>&1 | tee "$out/fidelity.txt"
step "done"
