#!/usr/bin/env bash
# The real engine's checks that need a CUDA GPU, as one script: under 10 minutes
# on one GPU, each part with its own time limit (T_TESTS, T_FLOOR, T_OFFLINE, T_SERVE s):
#   1. the torch executor and server tests, on CPU and CUDA (tests/torch parametrises over
#      every device present);
#   2. benchmarks/decode_floor.py on CUDA in bfloat16 (the CUDA default): the weight floor
#      from the GPU's measured read bandwidth, the GEMM time, the decode step, batches
#      1/8/32/128, with attention reading the KV blocks in place (FlexAttention, opt-in
#      until this check shows it right and faster) and with the gather path (the default);
#   3. benchmarks/offline_throughput.py --device cuda (kvloop alone, the quick workloads);
#   4. benchmarks/server_overhead.py --device cuda: TTFT and ITL seen over HTTP against the
#      engine's own, 16 streaming clients.
# Usage: benchmarks/gpu_check.sh   (from the repository root, kvloop installed or in src/)
# Results go to $OUT (default ./gpu-check-out); PYTHON picks the interpreter.
set -uo pipefail
. "$(dirname "$0")/gpu_common.sh"

step "tests: torch executor and server, CPU and CUDA"
timeout ${T_TESTS:-180} $py -m pytest -q -p no:cacheprovider -m "not ray" tests/torch tests/server 2>&1 \
    | tail -15 | tee "$out/pytest.txt"

step "decode steps against the weight floor, CUDA bfloat16, attention in place (flex)"
timeout ${T_FLOOR:-90} $py benchmarks/decode_floor.py --device cuda --dtype bfloat16 \
    --batches 1,8,32,128 --attention flex 2>&1 | tee "$out/decode_floor.txt"

step "the same with the gather path, for the ratio"
timeout ${T_FLOOR:-90} $py benchmarks/decode_floor.py --device cuda --dtype bfloat16 \
    --batches 1,8,32,128 --attention gather 2>&1 | tee "$out/decode_floor_gather.txt"

step "offline throughput, CUDA"
timeout ${T_OFFLINE:-120} $py benchmarks/offline_throughput.py --device cuda --engines kvloop --quick \
    --json "$out/offline.json" 2>&1 | tail -20 | tee "$out/offline.txt"

step "serving: HTTP against the engine's own timings, CUDA"
timeout ${T_SERVE:-120} $py benchmarks/server_overhead.py --device cuda --clients 16 --max-tokens 64 \
    --json "$out/server.json" 2>&1 | tail -12 | tee "$out/server.txt"

step "done"
ls -la "$out"
