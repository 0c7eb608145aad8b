#!/usr/bin/env bash
# Continued pretraining of an 8B Llama-3.1-architecture model (Marin-8B) with the MHAR
# delta variant (recipe cpt_8b_mhar_delta, recipes/), multi-node: 4 nodes
# of 8 GPUs by default (tensor parallel 4 within a node, data parallel across), any
# count with -N.
#
#   cd megatron_mhar                                  # submit from the repository root
#   export MHAR_MARIN_8B_CKPT=/ckpt/marin8b_delta_tp4 # start point: HF weights converted by
#                                                     # mhar-convert hf-to-mcore
#   export MHAR_CPT_DATA_PREFIX=/data/llama3/cpt_text_document  # .bin/.idx prefix (Llama-3 tokens)
#   export MHAR_LLAMA3_TOKENIZER=/models/Meta-Llama-3.1-8B      # directory with tokenizer.json
#   sbatch slurm/cpt_8b_mhar_delta.sh                 # 4 nodes x 8 GPUs
#   sbatch -N 8 slurm/cpt_8b_mhar_delta.sh            # 8 nodes: 2x the data-parallel ranks
#   sbatch slurm/cpt_8b_mhar_delta.sh checkpoint.interval=250
#
# Check first, without an allocation: every input (variables, paths, the recipe's launch
# checks) is checked and all problems listed at once (exit 2); nothing starts:
#   bash slurm/cpt_8b_mhar_delta.sh --check                  (or MHAR_DRY_RUN=1 sbatch ...)
# A submitted job makes the same checks before srun starts any rank.
#
# Arguments are recipe overrides (dotted.key=value) and win over everything else. The
# job log is <job name>-<job id>.log in the directory you submitted from; the run
# directory (metrics.jsonl, TensorBoard, checkpoints) is runs/cpt_8b_mhar_delta.
#
# The first run starts from MHAR_MARIN_8B_CKPT (weights only: new optimizer, schedule
# and data order); every later run of the job resumes from its own newest checkpoint,
# which always wins over MHAR_MARIN_8B_CKPT.
#
# Time limit and preemption: 10 minutes before --time runs out, Slurm sends SIGUSR1 to
# this script; the ranks finish their step, save a checkpoint and exit, and the job
# requeues itself; the requeued job resumes from the checkpoint (same job id, same log).
# The whole run (9,500 steps of 1M tokens) takes about a day on 32 H100s, in slices of
# --time. By hand:   scancel --batch --signal=USR1 <job id>    (checkpoint and requeue)
#                    scancel <job id>                          (checkpoint and stop)
# Submitting the same command again also continues from the newest checkpoint.
#
# CPU smoke run of this same script (what tests/slurm does, on a CPU-only Slurm):
#   RECIPE=smoke_cpu sbatch -N 1 --gpus-per-node=0 --ntasks-per-node=1 \
#       slurm/cpt_8b_mhar_delta.sh mhar.variant=delta training.train_iters=50
#
# ---------------------------------------------------------------------------- resources
#SBATCH --job-name=cpt_8b_mhar_delta
#SBATCH --nodes=4
# One rank per GPU: keep --ntasks-per-node equal to --gpus-per-node.
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
# SIGUSR1 to this script (B:) 600 s before the limit: an 8B checkpoint with its
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
export RECIPE=${RECIPE:-cpt_8b_mhar_delta}
# Start point, training data and tokenizer, read by the recipe (required, no default):
# a Megatron checkpoint converted from the HF weights, a Megatron .bin/.idx prefix
# written with the Llama-3 tokenizer, and that tokenizer's directory (tokenizer.json).
# Export them in the shell you submit from (see the usage above).
#   MHAR_MARIN_8B_CKPT, MHAR_CPT_DATA_PREFIX, MHAR_LLAMA3_TOKENIZER
# Where checkpoints go and where a (re)started job resumes from; empty: runs/<run name>/checkpoints.
export CKPT_DIR=${CKPT_DIR:-}
# Run name and parent directory of the run directory; empty: the recipe's (runs/cpt_8b_mhar_delta).
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
