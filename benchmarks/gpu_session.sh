#!/usr/bin/env bash
# One lent GPU's checks in one call, cheapest and most telling first, each part under its own
# time limit so that a slow part cannot take the others' time. Everything lands in $OUT (or the
# folder given) as one tarball, rewritten after each part (a call stopped at its limit keeps what
# finished), plus the log. Runs where the working tree is: PYTHONPATH=src, no install.
#
#   bash benchmarks/gpu_session.sh [OUT] [SECONDS]      # SECONDS: the whole budget (default 540)
#
# The parts and their shares of the budget: kernel scratch (5%), remat.auto on a CUDA model (5%),
# allocator + eager memory (15%), op-by-op memory (15%), eager and compiled speed (30%), compiled
# memory on gpt2 (20%), offload (10%). The first GPU run (stop 48, docs/benchmarks.md) took 82 s for the first three on an H100.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-benchmarks/results}}"
budget="${2:-540}"
work="$(mktemp -d)"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"

pack() { tar czf "$out/gpu-session.tgz.tmp" -C "$work" . && mv "$out/gpu-session.tgz.tmp" "$out/gpu-session.tgz"; }
part() {  # part SHARE_PERCENT NAME COMMAND...
    local limit=$(( budget * $1 / 100 )) name=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@"
    echo "== $name: exit $? after $(( SECONDS - start )) s"
    pack
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
    part 5 "kernel scratch" python3 benchmarks/gpu_kernel_scratch.py --out "$work"
    part 5 "remat.auto on a CUDA model" python3 benchmarks/gpu_auto.py --out "$work"
    part 15 "allocator and eager memory" python3 benchmarks/gpu_validate.py \
        --parts allocator memory --skip-compiled --out "$work"
    part 15 "op by op" python3 benchmarks/gpu_op_memory.py --out "$work"
    part 30 "speed" python3 benchmarks/gpu_validate.py --parts speed --out "$work"
    part 20 "compiled memory" python3 benchmarks/gpu_validate.py --parts memory --models gpt2 \
        --strategies store_all full --out "$work/compiled"
    part 10 "offload" python3 benchmarks/gpu_validate.py --parts offload --out "$work"
} 2>&1 | tee "$out/gpu-session.log"
rm -rf "$work"
