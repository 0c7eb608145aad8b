#!/usr/bin/env bash
# Continued pretraining of Qwen3-30B-A3B (mixture of experts: 128 experts, top-8) with the
# MHAR delta variant (recipe cpt_30b_a3b_mhar_delta, recipes/), multi-node: 4 nodes of 8
# GPUs by default (expert parallel 8 within a node, data parallel across), any count of 4
# or more with -N. The control without routing is RECIPE=cpt_30b_a3b_plain.
#
#   cd megatron_mhar                                  # submit from the repository root
#   export MHAR_QWEN3_30B_A3B_CKPT=/ckpt/qwen3_30b_a3b_delta   # start point: HF weights
#                                                     # converted by mhar-convert hf-to-mcore
#   export MHAR_CPT_DATA_PREFIX=/data/qwen3/cpt_text_document  # .bin/.idx prefix (Qwen3 tokens)
#   export MHAR_QWEN3_TOKENIZER=/models/Qwen3-30B-A3B          # directory with tokenizer.json
#   sbatch slurm/cpt_30b_a3b_mhar_delta.sh            # 4 nodes x 8 GPUs
#   sbatch -N 8 slurm/cpt_30b_a3b_mhar_delta.sh       # 8 nodes: 2x the data-parallel ranks
#   RECIPE=cpt_30b_a3b_plain sbatch slurm/cpt_30b_a3b_mhar_delta.sh   # the control
#   sbatch slurm/cpt_30b_a3b_mhar_delta.sh checkpoint.interval=250
#
# The layout (the recipe's parallel section): each GPU holds 16 of the 128 experts of every
# layer and the whole attention; tokens reach their experts by an all-to-all inside the
# node. The driver prints its memory estimate per GPU at start (about 68 GB on 4 nodes;
# fewer nodes leave each GPU more of the experts' optimizer state: one node needs ~100 GB).
#
# Check first, without an allocation: every input (variables, paths, the recipe's launch
# checks) is checked and all problems listed at once (exit 2); nothing starts:
#   bash slurm/cpt_30b_a3b_mhar_delta.sh --check                  (or MHAR_DRY_RUN=1 sbatch ...)
# A submitted job makes the same checks before srun starts any rank.
#
# Arguments are recipe overrides (dotted.key=value) and win over everything else. The
# job log is <job name>-<job id>.log in the directory you submitted from; the run
# directory (metrics.jsonl with each expert's token load, TensorBoard, checkpoints) is
# runs/cpt_30b_a3b_mhar_delta.
#
# The first run starts from MHAR_QWEN3_30B_A3B_CKPT (weights only: new optimizer, schedule
# and data order); every later run of the job resumes from its own newest checkpoint,
# which always wins over MHAR_QWEN3_30B_A3B_CKPT.
#
# Time limit and preemption: 10 minutes before --time runs out, Slurm sends SIGUSR1 to
# this script; the ranks finish their step, save a checkpoint and exit, and the job
# requeues itself; the requeued job resumes from the checkpoint (same job id, same log).
# By hand:   scancel --batch --signal=USR1 <job id>    (checkpoint and requeue)
#            scancel <job id>                          (checkpoint and stop)
# Submitting the same command again also continues from the newest checkpoint.
#
# CPU smoke run of this same script (an MoE model on a CPU-only Slurm):
#   RECIPE=smoke_cpu_moe sbatch -N 1 --gpus-per-node=0 --ntasks-per-node=1 \
#       slurm/cpt_30b_a3b_mhar_delta.sh mhar.variant=delta training.train_iters=50
#
# ---------------------------------------------------------------------------- resources
#SBATCH --job-name=cpt_30b_a3b_mhar_delta
#SBATCH --nodes=4
# One rank per GPU: keep --ntasks-per-node equal to --gpus-per-node.
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
# SIGUSR1 to this script (B:) 600 s before the limit: a 30B checkpoint with its
# distributed optimizer state takes minutes to write on a slow file system.
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
# One log per job: the requeued runs append to it.
#SBATCH --output=%x-%j.log
#SBATCH --open-mode=append
set -euo pipefail

# ---------------------------------------------------------------------------- knobs
# Every knob is an environment variable: set it in the shell you submit from
# (sbatch passes the environment on) or edit the default here.

# The run configuration: a recipe name (recipes/NAME.yaml) or a YAML file,
# relative to the repository root or absolute.
export RECIPE=${RECIPE:-cpt_30b_a3b_mhar_delta}
# Start point, training data and tokenizer, read by the recipe (required, no default):
# a Megatron checkpoint converted from the HF weights, a Megatron .bin/.idx prefix
# written with the Qwen3 tokenizer, and that tokenizer's directory (tokenizer.json).
# Export them in the shell you submit from (see the usage above).
#   MHAR_QWEN3_30B_A3B_CKPT, MHAR_CPT_DATA_PREFIX, MHAR_QWEN3_TOKENIZER
# Where checkpoints go and where a (re)started job resumes from; empty: runs/<run name>/checkpoints.
export CKPT_DIR=${CKPT_DIR:-}
# Run name and parent directory of the run directory; empty: the recipe's (runs/cpt_30b_a3b_mhar_delta).
export RUN_NAME=${RUN_NAME:-}
export OUTPUT_DIR=${OUTPUT_DIR:-}
# Container image for pyxis/enroot (e.g. nvcr.io#nvidia/pytorch:25.01-py3 with
# megatron_mhar installed), and extra mounts src:dst[,...]; empty: run on the host.
export CONTAINER_IMAGE=${CONTAINER_IMAGE:-}
export CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-}
# Python with megatron_mhar installed (inside the image when CONTAINER_IMAGE is set).
export PYTHON=${PYTHON:-python}
# Ranks per node = GPUs per node; empty: the allocation's --gpus-per-node. 0: one CPU rank
# per node (smoke runs on CPU-only nodes).
export GPUS_PER_NODE=${GPUS_PER_NODE:-}
# The repository checkout to run; empty: the directory sbatch was called in.
export REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
if [[ ! -f $REPO_DIR/slurm/launch.sh ]]; then
    echo "error: REPO_DIR=$REPO_DIR has no slurm/launch.sh; submit from the megatron_mhar" \
        "repository root (cd megatron_mhar; sbatch slurm/...) or set REPO_DIR" >&2
    exit 2
fi

# ---------------------------------------------------------------------------- launch
# The shared launcher: srun ranks, rendezvous, NCCL/CUDA environment, signal handling
# and requeue. exec keeps this process (the batch shell Slurm signals) as the launcher.
# This script, whose #SBATCH lines give the layout a check outside an allocation uses.
export JOB_SCRIPT=${JOB_SCRIPT:-$0}
exec bash "$REPO_DIR/slurm/launch.sh" "$@"
