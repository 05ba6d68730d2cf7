# Sourced by the GPU check scripts (gpu_check.sh, sim_gpu_check.sh): the environment they
# share ($out, $py, PYTHONPATH), a `step` header, and the machine description in
# $out/machine.txt.
out=${OUT:-gpu-check-out}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() { echo; echo "=== $* ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 | tee "$out/machine.txt"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$out/machine.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$out/machine.txt"
