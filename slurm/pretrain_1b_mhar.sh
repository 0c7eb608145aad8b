#!/usr/bin/env bash
# Pretrain the 1B MHAR model (recipe pretrain_1b_mhar, recipes/) on one
# node of 8 GPUs, or on any number of nodes (data parallel) with sbatch -N.
#
#   cd megatron_mhar                                  # submit from the repository root
#   export MHAR_DATA_PREFIX=/data/qwen3/fineweb_text_document  # .bin/.idx prefix (Qwen3 tokens)
#   export MHAR_QWEN3_TOKENIZER=/models/Qwen3-0.6B-Base        # directory with tokenizer.json
#   sbatch slurm/pretrain_1b_mhar.sh                  # 1 node x 8 GPUs
#   sbatch -N 4 slurm/pretrain_1b_mhar.sh             # 4 nodes: 4x the data-parallel ranks
#   sbatch slurm/pretrain_1b_mhar.sh training.train_iters=5000 eval.interval=250
#
# Check first, without an allocation: every input (variables, paths, the recipe's launch
# checks) is checked and all problems listed at once (exit 2); nothing starts:
#   bash slurm/pretrain_1b_mhar.sh --check                  (or MHAR_DRY_RUN=1 sbatch ...)
# A submitted job makes the same checks before srun starts any rank.
#
# Arguments are recipe overrides (dotted.key=value) and win over everything else. The
# job log is <job name>-<job id>.log in the directory you submitted from; the run
# directory (metrics.jsonl, TensorBoard, checkpoints) is runs/pretrain_1b_mhar.
#
# Time limit and preemption: 5 minutes before --time runs out, Slurm sends SIGUSR1 to
# this script; the ranks finish their step, save a checkpoint and exit, and the job
# requeues itself; the requeued job resumes from the checkpoint (same job id, same log).
# Do the same by hand with:   scancel --batch --signal=USR1 <job id>
# Stop for good (the ranks still save first):   scancel <job id>
# Submitting the same command again also continues from the newest checkpoint.
#
# CPU smoke run of this same script (what tests/slurm does, on a CPU-only Slurm):
#   RECIPE=smoke_cpu sbatch --gpus-per-node=0 --ntasks-per-node=1 \
#       slurm/pretrain_1b_mhar.sh training.train_iters=50
#
# ---------------------------------------------------------------------------- resources
#SBATCH --job-name=pretrain_1b_mhar
#SBATCH --nodes=1
# One rank per GPU: keep --ntasks-per-node equal to --gpus-per-node.
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
# 20K steps of 32K tokens take a few hours on 8 H100/H200s; longer runs requeue themselves.
#SBATCH --time=04:00:00
# SIGUSR1 to this script (B:) 300 s before the limit: checkpoint, exit, requeue.
#SBATCH --signal=B:USR1@300
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
export RECIPE=${RECIPE:-pretrain_1b_mhar}
# Training data, read by the recipe (required, no default): a Megatron .bin/.idx prefix
# written with the Qwen3 tokenizer, and that tokenizer's directory (tokenizer.json).
# Export both in the shell you submit from (see the usage above); write the data with
# mhar-preprocess (python -m megatron_mhar.data.preprocess).
#   MHAR_DATA_PREFIX, MHAR_QWEN3_TOKENIZER
# Where checkpoints go and where a (re)started job resumes from; empty: runs/<run name>/checkpoints.
export CKPT_DIR=${CKPT_DIR:-}
# Run name and parent directory of the run directory; empty: the recipe's (runs/pretrain_1b_mhar).
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
