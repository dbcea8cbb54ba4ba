#!/usr/bin/env bash
# megappo on one node: torchrun starts NPROC ranks of `megappo train` (one per GPU; on a CPU
# machine, gloo ranks).
#
#   tools/launch/torchrun_1node.sh NPROC RECIPE.yaml [key.sub=value ...] [--world-size N]
#   tools/launch/torchrun_1node.sh 8 recipes/qwen2.5-7b-ppo-8gpu.yaml run.output_dir=runs/q7b
#
# Everything after the recipe goes to `megappo train` unchanged (dotted overrides). NPROC
# must be a multiple of parallel.tp * parallel.pp; the rest is data parallelism. Check the
# layout and the memory first: `megappo plan RECIPE.yaml --world-size NPROC`.
# Rendezvous is torchrun's --standalone (a free local port), so several single-node runs can
# share a machine. OMP_NUM_THREADS defaults to the cores per rank; set it to override.
set -euo pipefail

if [ "$#" -lt 2 ]; then
    echo "usage: $0 NPROC RECIPE.yaml [key.sub=value ...]" >&2
    exit 2
fi
NPROC=$1
RECIPE=$2
shift 2
case "$NPROC" in
    ''|*[!0-9]*) echo "$0: NPROC must be a number of ranks, got '$NPROC'" >&2; exit 2 ;;
esac

CORES=$(nproc 2>/dev/null || echo 1)
PER_RANK=$(( CORES / NPROC ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( PER_RANK > 0 ? PER_RANK : 1 ))}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

exec torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC" -m megappo.cli train "$RECIPE" "$@"
