#!/usr/bin/env bash
# Shared Slurm launcher of megatron_mhar training: started (exec'd) by the sbatch scripts
# in this folder, never submitted itself. Read this file top to bottom to see everything
# a job does.
#
#   launch.sh [dotted.key=value ...]      (inside an allocation; RECIPE in the environment)
#   launch.sh --check [dotted.key=value ...]   (or MHAR_DRY_RUN=1: anywhere, no allocation
#                                         needed; `bash slurm/<script>.sh --check` runs it)
#
# What it does:
#   0. Checks every input before any rank starts: the knobs below, then the run
#      configuration with its files and the environment variables its paths use
#      (mhar-train --check, for the job's world size; not the GPUs, which the batch node
#      may lack). Every problem found is listed at once and the script exits 2. With
#      --check / MHAR_DRY_RUN=1 it then prints the srun command and the configuration,
#      and exits without starting ranks.
#   1. One rank per GPU, started by srun directly (srun-native ranks, no torchrun): each
#      task gets RANK / LOCAL_RANK / WORLD_SIZE from Slurm and rendezvouses at
#      MASTER_ADDR:MASTER_PORT on the first node of the allocation. Signals sent to srun
#      reach every rank directly, with no agent in between that could time them out.
#   2. Time limit and preemption. The batch shell (this script) traps two signals:
#      SIGUSR1  sbatch --signal=B:USR1@<seconds> sends it before the time limit (or you do,
#               with scancel --batch --signal=USR1 <job>): it is forwarded to the ranks,
#               which finish the current step, save a checkpoint and exit 0; this script
#               then requeues the job (scontrol requeue), and the requeued job resumes
#               from the checkpoint directory's `latest` with no manual step.
#      SIGTERM  scancel, or Slurm at the time limit / on preemption: forwarded likewise,
#               the ranks save and exit, and the job ends without requeueing itself (a
#               preempting Slurm requeues it on its own when PreemptMode=REQUEUE).
#   3. One log per job: the sbatch scripts append (--open-mode=append) the output of
#      every run of the job, requeued runs included, to one file; every line a rank
#      prints is prefixed with its rank (srun --label).
#
# Knobs: environment variables (sbatch passes the submitting shell's environment; the
# sbatch scripts set the defaults of their job). Training overrides are this script's
# arguments and win over the knobs' overrides.
#   RECIPE           (required) recipe name (recipes/NAME.yaml) or a YAML
#                    file, relative to REPO_DIR or absolute
#   REPO_DIR         checkout to run from; default: the directory sbatch was called in
#   GPUS_PER_NODE    ranks per node, one per GPU; default: the allocation's --gpus-per-node.
#                    0 runs one CPU rank per node (gloo, run.device=cpu): the smoke mode
#   RUN_NAME         run.name override (the run directory is OUTPUT_DIR/RUN_NAME)
#   OUTPUT_DIR       run.output_dir override
#   CKPT_DIR         checkpoint.dir override (default: <run directory>/checkpoints); a job
#                    always resumes from the newest complete checkpoint found there
#   PYTHON           interpreter with megatron_mhar installed; default: python
#   CONTAINER_IMAGE  run the ranks in this image through pyxis/enroot (srun
#                    --container-image); the image needs megatron_mhar's dependencies
#   CONTAINER_MOUNTS extra pyxis mounts, src:dst[,src:dst...]; REPO_DIR is always mounted
#   MASTER_PORT      rendezvous port on the first node; default: 20000 + job id % 20000
#   NODES            for a check outside an allocation: the nodes of the job; default: the
#                    job script's #SBATCH --nodes (GPUS_PER_NODE: its --gpus-per-node)
#   MHAR_DRY_RUN     1: check and print the command and configuration, start no rank
# NCCL/CUDA variables set below keep any value already in the environment.
set -euo pipefail

log() { echo "[launch $(date +%H:%M:%S)] $*"; }
# Exit 2, as every megatron_mhar command does for a problem of input or environment.
die() { log "error: $*" >&2; exit 2; }

CHECK=${MHAR_DRY_RUN:-0}
if [[ ${1:-} == --check ]]; then
    CHECK=1
    shift
fi
[[ $CHECK == 1 || -n ${SLURM_JOB_ID:-} ]] \
    || die "not inside a Slurm job: submit an sbatch script from slurm/ (or check one: bash slurm/<script>.sh --check)"
problems=()        # every problem found before srun, reported together

# The job script's own #SBATCH value of an option, for a check outside an allocation.
sbatch_default() {
    [[ -f ${JOB_SCRIPT:-} ]] || return 0
    sed -n "s/^#SBATCH --$1=\\([^ ]*\\).*/\\1/p" "$JOB_SCRIPT" | head -n 1
}

# ---------------------------------------------------------------------------- where
[[ -n ${RECIPE:-} ]] || problems+=("RECIPE is not set (the sbatch scripts set it)")
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
if [[ -f $REPO_DIR/megatron_mhar/train.py ]]; then
    cd "$REPO_DIR"
else
    problems+=("REPO_DIR=$REPO_DIR is not a megatron_mhar checkout; submit from the repository root or set REPO_DIR")
fi
PYTHON=${PYTHON:-python}
command -v "$PYTHON" >/dev/null || [[ -n ${CONTAINER_IMAGE:-} ]] \
    || problems+=("PYTHON=$PYTHON: no such command; set PYTHON to the interpreter with megatron_mhar installed")

# ---------------------------------------------------------------------------- ranks
NNODES=${SLURM_JOB_NUM_NODES:-${NODES:-$(sbatch_default nodes)}}
NNODES=${NNODES:-1}
# --gpus-per-node may carry a type (h100:8): keep the count.
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-$(sbatch_default gpus-per-node)}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
GPUS_PER_NODE=${GPUS_PER_NODE##*:}
if ! [[ $GPUS_PER_NODE =~ ^[0-9]+$ ]]; then
    problems+=("GPUS_PER_NODE=$GPUS_PER_NODE is not a number")
    GPUS_PER_NODE=8
fi
if ((GPUS_PER_NODE == 0)); then
    RANKS_PER_NODE=1        # CPU smoke mode: one gloo rank per node
else
    RANKS_PER_NODE=$GPUS_PER_NODE
fi
WORLD_SIZE=$((NNODES * RANKS_PER_NODE))
# The node's CPUs, shared evenly by its ranks (srun does not inherit sbatch's
# --cpus-per-task since Slurm 22.05, so it is passed explicitly).
CPUS_ON_NODE=${SLURM_CPUS_ON_NODE:-$(nproc)}
CPUS_PER_RANK=$((CPUS_ON_NODE / RANKS_PER_NODE))
((CPUS_PER_RANK >= 1)) || CPUS_PER_RANK=1

# Rendezvous on the first node; the port depends on the job id so that jobs sharing a
# node do not collide.
if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
else
    MASTER_ADDR=localhost   # a check outside an allocation
fi
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export MASTER_ADDR MASTER_PORT
export LOCAL_WORLD_SIZE=$RANKS_PER_NODE

# ---------------------------------------------------------------------------- environment
export PYTHONUNBUFFERED=1                  # stream rank output into the job log
if ((GPUS_PER_NODE > 0)); then
    # Megatron: one hardware queue per device keeps tensor/sequence-parallel
    # communication kernels ordered with compute (required for TP comm overlap).
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    # Release NCCL buffers as soon as their stream is done (Megatron's recommendation).
    export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
    # A failed collective tears the job down instead of hanging until the time limit.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    # GPU ranks do their CPU work in a few threads; data loading is not CPU-bound here.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # Cluster-specific NCCL settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) belong in
    # the environment you submit from, or in the container image.
else
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$CPUS_PER_RANK}
fi

# ---------------------------------------------------------------------------- overrides
overrides=()
((GPUS_PER_NODE > 0)) || overrides+=(run.device=cpu)
[[ -z ${RUN_NAME:-} ]] || overrides+=("run.name=$RUN_NAME")
[[ -z ${OUTPUT_DIR:-} ]] || overrides+=("run.output_dir=$OUTPUT_DIR")
[[ -z ${CKPT_DIR:-} ]] || overrides+=("checkpoint.dir=$CKPT_DIR")
overrides+=("$@")                          # the job's own arguments come last and win

# ---------------------------------------------------------------------------- srun
srun_args=(
    --nodes="$NNODES"
    --ntasks-per-node="$RANKS_PER_NODE"
    --ntasks="$WORLD_SIZE"
    --cpus-per-task="$CPUS_PER_RANK"
    --kill-on-bad-exit=1                   # one rank fails: stop the others
    --label                                # "<rank>: " before every line
)
if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    srun_args+=(
        --container-image="$CONTAINER_IMAGE"
        --container-mounts="$REPO_DIR:$REPO_DIR${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
        --container-workdir="$REPO_DIR"
    )
fi
# Each task turns Slurm's numbering into torch.distributed's, then becomes the trainer
# (exec: signals from srun reach Python itself).
# shellcheck disable=SC2016  # expanded by the task's shell, not here
rank_env='export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS NODE_RANK=$SLURM_NODEID; exec "$@"'
train_cmd=("$PYTHON" -m megatron_mhar.train "$RECIPE" "${overrides[@]}")

# ---------------------------------------------------------------------------- check
# The configuration, its files and the variables its paths use, for this world size,
# before any rank starts (inside an image, the ranks check it themselves).
config=""
if ((${#problems[@]} == 0)) && [[ -z ${CONTAINER_IMAGE:-} ]]; then
    if ! config=$(WORLD_SIZE=$WORLD_SIZE "$PYTHON" -m megatron_mhar.train "$RECIPE" "${overrides[@]}" --check 2>&1); then
        problems+=("$(grep -v '^(MHAR_TRACEBACK' <<<"$config" | sed 's/^mhar-train: error: //')")
    fi
fi
if ((${#problems[@]} > 0)); then
    log "not started: ${#problems[@]} problem(s) with the job's inputs" >&2
    for problem in "${problems[@]}"; do
        echo "error: $problem" >&2
    done
    exit 2
fi
if [[ $CHECK == 1 ]]; then
    log "check only (--check / MHAR_DRY_RUN=1): $NNODES node(s) x $RANKS_PER_NODE ranks, no rank started"
    echo "command: srun ${srun_args[*]} bash -c '$rank_env' rank ${train_cmd[*]}"
    echo "${config:-(configuration not checked here: the ranks run in $CONTAINER_IMAGE)}"
    exit 0
fi

log "job $SLURM_JOB_ID (${SLURM_JOB_NAME:-}) run $((${SLURM_RESTART_COUNT:-0} + 1)), restarts so far: ${SLURM_RESTART_COUNT:-0}"
log "nodes: $NNODES x $RANKS_PER_NODE ranks ($([[ $GPUS_PER_NODE -gt 0 ]] && echo "$GPUS_PER_NODE GPUs" || echo CPU)), $CPUS_PER_RANK CPUs per rank, rendezvous $MASTER_ADDR:$MASTER_PORT"
log "repo: $REPO_DIR ($(git -C "$REPO_DIR" rev-parse --short HEAD 2>/dev/null || echo 'no git'))${CONTAINER_IMAGE:+, image $CONTAINER_IMAGE}"
log "command: ${train_cmd[*]}"

# ---------------------------------------------------------------------------- signals
stop_signal=""     # the signal that asked the run to stop, if any
srun_pid=""
# shellcheck disable=SC2317  # called by the traps below
forward() {
    stop_signal=$1
    if [[ -n $srun_pid ]]; then
        log "received SIG$1: forwarding it to the ranks (they save a checkpoint and exit)"
        kill -s "$1" "$srun_pid" 2>/dev/null || true
    else
        log "received SIG$1 before the ranks started"
    fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

if [[ -z $stop_signal ]]; then
    srun "${srun_args[@]}" bash -c "$rank_env" rank "${train_cmd[@]}" &
    srun_pid=$!
    # `wait` returns early whenever a trapped signal arrives: keep waiting until srun ends.
    status=0
    while :; do
        wait "$srun_pid" && status=0 || status=$?
        kill -0 "$srun_pid" 2>/dev/null || break
    done
    # The last wait may have been cut short by a signal just as srun ended; then srun's
    # status is still there to collect (127: it was collected already).
    if ((status > 128)); then
        again=0
        wait "$srun_pid" 2>/dev/null || again=$?
        ((again == 127)) || status=$again
    fi
else
    status=0
fi

# ---------------------------------------------------------------------------- requeue
if [[ $stop_signal == USR1 && $status -eq 0 ]]; then
    log "the ranks saved and exited: requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint"
    if scontrol requeue "$SLURM_JOB_ID"; then
        exit 0
    fi
    die "scontrol requeue failed (was the job submitted with --requeue, and JobRequeue allowed?); submit the same command again to resume"
fi
if [[ -n $stop_signal ]]; then
    log "stopped by SIG$stop_signal, exit status $status; not requeueing (submit again to resume)"
else
    log "training exited with status $status"
fi
exit "$status"
