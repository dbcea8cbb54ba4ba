#!/usr/bin/env bash
# megappo on one node: torchrun starts NPROC ranks of `megappo train` (one per GPU; on a CPU
# machine, gloo ranks).
#
#   tools/launch/torchrun_1node.sh [NPROC] RECIPE.yaml [--variant NAME] [key.sub=value ...] [--world-size N]
#   tools/launch/torchrun_1node.sh recipes/qwen2.5-7b-ppo-8gpu.yaml run.output_dir=runs/q7b
#   tools/launch/torchrun_1node.sh recipes/qwen2.5-7b-ppo-8gpu.yaml --variant 4gpu
#
# NPROC defaults to the recipe's hardware.gpus_per_node (`megappo hardware RECIPE ...` reads it, the
# variant and overrides applied); a recipe sized for several nodes is refused without NPROC (use
# tools/launch/slurm_multinode.sbatch). Everything after the recipe goes to `megappo train` unchanged;
# an NPROC other than the recipe's hardware gets a warning from `megappo train` that names the fix.
# NPROC must be a multiple of parallel.tp * parallel.pp; the rest is data parallelism. Check the
# layout and the memory first: `megappo plan RECIPE.yaml [--variant NAME]` (docs/planner.md).
# Rendezvous is torchrun's --standalone (a free local port), so several single-node runs can
# share a machine. OMP_NUM_THREADS defaults to the cores per rank; set it to override.
set -euo pipefail

if [ "$#" -lt 1 ]; then
    echo "usage: $0 [NPROC] RECIPE.yaml [--variant NAME] [key.sub=value ...]" >&2
    exit 2
fi
NPROC=
case "$1" in
    *.yaml|*.yml) ;;
    ''|*[!0-9]*) echo "$0: NPROC must be a number of ranks (or leave it out: the recipe's hardware), got '$1'" >&2
                 exit 2 ;;
    *) NPROC=$1; shift ;;
esac
if [ "$#" -lt 1 ]; then
    echo "usage: $0 [NPROC] RECIPE.yaml [--variant NAME] [key.sub=value ...]" >&2
    exit 2
fi
RECIPE=$1
shift

if [ -z "$NPROC" ]; then
    # MEGAPPO_NODES, MEGAPPO_GPUS_PER_NODE, MEGAPPO_WORLD_SIZE, ... of the recipe (variant and overrides applied)
    HARDWARE=$("${PYTHON:-python}" -m megappo.cli hardware "$RECIPE" "$@") || exit $?
    eval "$HARDWARE"
    if [ "$MEGAPPO_NODES" -gt 1 ]; then
        echo "$0: $RECIPE is sized for $MEGAPPO_NODES nodes x $MEGAPPO_GPUS_PER_NODE GPUs (its hardware section)." \
             "Fix: launch it with tools/launch/slurm_multinode.sbatch, or give NPROC to run it on this node" \
             "(plan that first: megappo plan $RECIPE --world-size NPROC)." >&2
        exit 2
    fi
    NPROC=$MEGAPPO_GPUS_PER_NODE
fi

CORES=$(nproc 2>/dev/null || echo 1)
PER_RANK=$(( CORES / NPROC ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( PER_RANK > 0 ? PER_RANK : 1 ))}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

exec torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC" -m megappo.cli train "$RECIPE" "$@"
