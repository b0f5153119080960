#!/usr/bin/env bash
# Create, reach and delete Cloud TPU VMs, and run one command on their workers.
#
# usage: scripts/tpu_vm.sh COMMAND NAME --zone=ZONE [options] [--dry-run]
#
#   create NAME --zone=Z --type=v4-32 [--engine=tf|jax] [--version=RUNTIME]
#          [--spot|--reserved] [--slices=N]
#       Creates a slice. RUNTIME (the TPU software version) defaults to the one
#       for the type's generation, its host count (more than 8 in the type's
#       count is several hosts) and the engine, tf unless --engine=jax: see the
#       table at the end of --help; --version=RUNTIME overrides it. --spot asks
#       for spot capacity, --reserved for your reservation's, through a queued
#       resource, which waits until there is some. --slices=N (multislice, v4
#       and later, jax engine) asks for N slices of the type as one queued
#       resource NAME, whose slices are named NAME-0 ... NAME-<N-1>.
#   delete NAME --zone=Z [--spot|--reserved|--slices=N]
#       Deletes the slice; with --spot, --reserved or --slices, its queued
#       resource and every slice it made.
#   ssh NAME --zone=Z [--worker=0]
#       Opens a shell on one worker.
#   copy NAME --zone=Z [--dir=tpu_keras] [--install] [--slices=N]
#       Copies this checkout (the package, configs, scripts and setup files)
#       into DIR on every worker; --install then runs `pip install -e .` there.
#       --slices=N: on every worker of every slice NAME-0 ... NAME-<N-1>.
#   run NAME --zone=Z [--dir=tpu_keras] [--worker=all] [--tf-pod] [--env=K=V]...
#       [--slices=N] -- COMMAND...
#       Runs COMMAND in DIR on every worker (or on --worker=N) with
#       TPU_NAME=local: each worker drives its own chips, which is right for
#       the jax engine and for any single-host slice. --tf-pod is for the tf
#       engine on a slice of several hosts, where one TensorFlow process
#       drives every host: it runs on worker 0 only, with TPU_NAME=NAME and
#       TPU_LOAD_LIBRARY=0. --env adds variables to COMMAND's environment.
#       --slices=N runs COMMAND on every slice NAME-0 ... NAME-<N-1> at once
#       (the jax engine: every host of every slice is one process of the run),
#       and ends with the first failing slice's exit code. ssh reaches one
#       slice of several by its own name: ssh NAME-1.
#
# Every command takes --project=P (else gcloud's default project) and
# --dry-run, or TPU_VM_DRY_RUN=1 in the environment: print the gcloud
# commands, one per line, and run nothing. --dry-run goes anywhere before --;
# after --, it is refused, since it would be COMMAND's and gcloud would run.
# Options take --opt=value or --opt value. DIR is relative to the home
# directory on the VMs. Everything after -- is COMMAND, passed on word for word.
#
# Generations: v2, v3, v4, v5e (type v5litepod-N), v5p and v6e, through the
# Cloud TPU API (`gcloud compute tpus`). That API is no longer actively
# developed and does not serve TPU7x (Ironwood) or later generations, which
# Compute Engine or GKE create instead; this script does not cover them.
#
# example (a v4-32, 4 hosts, tf engine):
#   scripts/tpu_vm.sh create my-tpu --zone=us-central2-b --type=v4-32
#   scripts/tpu_vm.sh copy my-tpu --zone=us-central2-b --install
#   scripts/tpu_vm.sh run my-tpu --zone=us-central2-b --tf-pod -- \
#       python3 -m tpu_keras.train --config=configs/lm_stdlib.py --workdir=gs://BUCKET/lm
#   scripts/tpu_vm.sh delete my-tpu --zone=us-central2-b
#
# example (two v5e-256 slices, multislice, jax engine):
#   scripts/tpu_vm.sh create my-ms --zone=us-west4-a --type=v5litepod-256 --slices=2 --engine=jax
#   scripts/tpu_vm.sh run my-ms --zone=us-west4-a --slices=2 -- python3 -m tpu_keras.train ...
#   scripts/tpu_vm.sh delete my-ms --zone=us-west4-a --slices=2

set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO
# What a run needs on the VMs (setup.cfg reads README.md); tests, .git and
# local outputs stay here.
CHECKOUT=(setup.py setup.cfg README.md tpu_keras configs scripts)
# The runtime (TPU software version) `create` picks, per generation and engine:
# https://cloud.google.com/tpu/docs/runtimes ("TPU software versions"). JAX uses
# the page's base images ("v4 and older": tpu-ubuntu2204-base), with jax
# installed on top. TensorFlow images are tpu-vm-tf-X.Y.Z[-pod]-pjrt; -pod is
# the multi-host image, whose TPU servers give every host's chips to the one
# TensorFlow client on worker 0. 2.18.0 is the newest TensorFlow the page lists;
# v5e and v6e have images of their own, with the suffix -v5e-and-v6 (not read
# on the page itself: seen created on v5litepod-8 and -16 in public gcloud
# command lines). The plain names for v2-v5p follow the page's naming rule but
# were not confirmed either; one public listing of a zone's versions showed
# tpu-vm-tf-2.18.0-pjrt-v5p-and-below instead. Check a zone's with
# `gcloud compute tpus tpu-vm versions list --zone=ZONE`, and pass --version.
RUNTIMES=(
  # type prefix  tf, one host                      tf, several hosts                     jax
  "v2            tpu-vm-tf-2.18.0-pjrt              tpu-vm-tf-2.18.0-pod-pjrt              tpu-ubuntu2204-base"
  "v3            tpu-vm-tf-2.18.0-pjrt              tpu-vm-tf-2.18.0-pod-pjrt              tpu-ubuntu2204-base"
  "v4            tpu-vm-tf-2.18.0-pjrt              tpu-vm-tf-2.18.0-pod-pjrt              tpu-ubuntu2204-base"
  "v5litepod     tpu-vm-tf-2.18.0-pjrt-v5e-and-v6   tpu-vm-tf-2.18.0-pod-pjrt-v5e-and-v6   v2-alpha-tpuv5-lite"
  "v5p           tpu-vm-tf-2.18.0-pjrt              tpu-vm-tf-2.18.0-pod-pjrt              v2-alpha-tpuv5"
  "v6e           tpu-vm-tf-2.18.0-pjrt-v5e-and-v6   tpu-vm-tf-2.18.0-pod-pjrt-v5e-and-v6   v2-alpha-tpuv6e"
)
readonly RUNTIMES

COMMAND="" NAME="" ZONE="" TYPE="" ENGINE="tf" VERSION="" PROJECT="" WORKER="" DIR="tpu_keras"
SPOT=0 RESERVED=0 SLICES=1 INSTALL=0 TF_POD=0 DRY_RUN=0 HAVE_REMOTE=0
# Generations Cloud TPU offers as multislice: "v4 and later"
# (https://cloud.google.com/tpu/docs/multislice-introduction).
readonly MULTISLICE="v4 v5litepod v5p v6e"
ENVS=() REMOTE=() SEEN=()

usage() {  # the header above, then the runtime table
  sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
  printf '\nRuntimes create picks (--version overrides; source in the script):\n'
  printf '  %-10s %-35s %-38s %s\n' "type" "tf, one host" "tf, several hosts" "jax"
  local row
  for row in "${RUNTIMES[@]}"; do
    # shellcheck disable=SC2086  # the row's words are the columns
    printf '  %-10s %-35s %-38s %s\n' $row
  done
}

fail() {  # one line that says what to write instead; exit 2 like argparse
  printf 'tpu_vm.sh: error: %s\n' "$*" >&2
  exit 2
}

quote() {  # one word for a POSIX shell, quoted only when it has to be
  local safe='^[A-Za-z0-9_./:=@%+,-]+$' option='^--[a-z][a-z0-9._-]*='
  if [[ $1 =~ $safe ]]; then
    printf '%s' "$1"
  elif [[ $1 =~ $option ]]; then  # --command='...' reads better than '--command=...'
    printf '%s' "${BASH_REMATCH[0]}"
    quote "${1#"${BASH_REMATCH[0]}"}"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

words() {  # all arguments quoted, space-separated: a command line
  local line="" word
  for word in "$@"; do line+="${line:+ }$(quote "$word")"; done
  printf '%s' "$line"
}

gcloud_do() {  # gcloud "$@" (plus --project), or just its line with --dry-run
  local args=("$@")
  if [[ -n $PROJECT ]]; then args+=("--project=$PROJECT"); fi
  if (( DRY_RUN )); then
    printf 'gcloud %s\n' "$(words "${args[@]}")"
  else
    printf '+ gcloud %s\n' "$(words "${args[@]}")" >&2
    gcloud "${args[@]}"
  fi
}

on_workers() {  # runs the shell line $2 on workers $1 of the slice (of slice $3, default NAME)
  gcloud_do compute tpus tpu-vm ssh "${3:-$NAME}" "--zone=$ZONE" "--worker=$1" "--command=$2"
}

nodes() {  # the slices: NAME, or the queued resource's NAME-0 ... NAME-<N-1> (its --node-prefix)
  if (( SLICES > 1 )); then
    local i
    for ((i = 0; i < SLICES; i++)); do printf '%s\n' "$NAME-$i"; done
  else
    printf '%s\n' "$NAME"
  fi
}

# ---- subcommands -------------------------------------------------------------

cmd_create() {
  local version="${VERSION:-$(runtime "$TYPE" "$ENGINE")}" capacity=()
  if (( SPOT )); then capacity=(--spot); fi
  if (( RESERVED )); then capacity=(--reserved); fi
  if (( SLICES > 1 )); then
    # Multislice: one queued resource of N nodes (slices), named NAME-0, NAME-1, ...
    gcloud_do compute tpus queued-resources create "$NAME" "--node-count=$SLICES" \
      "--node-prefix=$NAME" "--zone=$ZONE" "--accelerator-type=$TYPE" \
      "--runtime-version=$version" ${capacity[@]+"${capacity[@]}"}
  elif (( SPOT || RESERVED )); then
    # Spot or reserved capacity comes through a queued resource; the node gets the same name.
    gcloud_do compute tpus queued-resources create "$NAME" "--node-id=$NAME" "--zone=$ZONE" \
      "--accelerator-type=$TYPE" "--runtime-version=$version" "${capacity[@]}"
  else
    gcloud_do compute tpus tpu-vm create "$NAME" "--zone=$ZONE" \
      "--accelerator-type=$TYPE" "--version=$version"
  fi
}

runtime_row() {  # the RUNTIMES row for type $1 (v4-32 -> the v4 row), or nothing
  local row
  for row in "${RUNTIMES[@]}"; do
    if [[ ${row%% *} == "${1%-*}" ]]; then printf '%s' "$row"; fi
  done
}

runtime() {  # the runtime for type $1 and engine $2: v4-32 tf -> tpu-vm-tf-2.18.0-pod-pjrt
  local prefix tf_one tf_pod jax
  read -r prefix tf_one tf_pod jax <<<"$(runtime_row "$1")"
  # The count after the dash is TensorCores (v2-v4, v5p) or chips (v5e, v6e);
  # either way one host has at most 8, so more than 8 means several hosts.
  if [[ $2 == jax ]]; then
    printf '%s' "$jax"
  elif (( ${1##*-} > 8 )); then
    printf '%s' "$tf_pod"
  else
    printf '%s' "$tf_one"
  fi
}

cmd_delete() {
  if (( SPOT || RESERVED || SLICES > 1 )); then
    # --force deletes the node the queued resource made, in whatever state.
    gcloud_do compute tpus queued-resources delete "$NAME" "--zone=$ZONE" --force --quiet
  else
    gcloud_do compute tpus tpu-vm delete "$NAME" "--zone=$ZONE" --quiet
  fi
}

cmd_ssh() {
  gcloud_do compute tpus tpu-vm ssh "$NAME" "--zone=$ZONE" "--worker=${WORKER:-0}"
}

cmd_copy() {
  local sources=() item
  for item in "${CHECKOUT[@]}"; do sources+=("$REPO/$item"); done
  # scp copies into DIR only if it exists, and then merges: a second copy
  # updates the files instead of nesting a new tpu_keras/ inside the old one.
  local node
  for node in $(nodes); do
    on_workers all "$(words mkdir -p "$DIR")" "$node"
    gcloud_do compute tpus tpu-vm scp "${sources[@]}" "$node:$DIR" "--zone=$ZONE" \
      --worker=all --recurse
    if (( INSTALL )); then
      on_workers all "$(words cd "$DIR") && $(words python3 -m pip install -e .)" "$node"
    fi
  done
}

cmd_run() {
  local env=(TPU_NAME=local) worker="${WORKER:-all}"
  if (( TF_POD )); then
    # TensorFlow's TPUStrategy is single-client on a pod: worker 0 reaches every
    # host's TPU server by the slice's name and must not open its chips itself.
    env=("TPU_NAME=$NAME" TPU_LOAD_LIBRARY=0) worker=0
  fi
  env+=(${ENVS[@]+"${ENVS[@]}"})
  local line node pids=() status=0 code
  line="$(words cd "$DIR") && $(words "${env[@]}" "${REMOTE[@]}")"
  if (( SLICES == 1 || DRY_RUN )); then
    for node in $(nodes); do on_workers "$worker" "$line" "$node"; done
    return
  fi
  # Every slice at once: the hosts of all slices are the processes of one run.
  for node in $(nodes); do
    on_workers "$worker" "$line" "$node" &
    pids+=($!)
  done
  for node in "${pids[@]}"; do
    if wait "$node"; then :; else code=$?; if (( status == 0 )); then status=$code; fi; fi
  done
  return "$status"
}

# ---- arguments ---------------------------------------------------------------

parse() {
  local positional=()
  while (( $# )); do
    case $1 in
      --) shift; REMOTE=("$@"); HAVE_REMOTE=1; break ;;
      --help|-h) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      --spot) SPOT=1; SEEN+=("$1") ;;
      --reserved) RESERVED=1; SEEN+=("$1") ;;
      --install) INSTALL=1; SEEN+=("$1") ;;
      --tf-pod) TF_POD=1; SEEN+=("$1") ;;
      --zone=*|--type=*|--engine=*|--version=*|--project=*|--worker=*|--dir=*|--env=*|--slices=*)
        set_value "${1%%=*}" "${1#*=}" ;;
      --zone|--type|--engine|--version|--project|--worker|--dir|--env|--slices)
        if (( $# < 2 )) || [[ $2 == -* ]]; then fail "$1 needs a value: write $1=VALUE"; fi
        set_value "$1" "$2"; shift ;;
      -*) SEEN+=("${1%%=*}") ;;  # reported once the command, and so its options, is known
      *) positional+=("$1") ;;
    esac
    shift
  done
  COMMAND="${positional[0]:-}"
  NAME="${positional[1]:-}"
  no_dry_run_in ${REMOTE[@]+"${REMOTE[@]}"}
  if (( ${#positional[@]} > 2 )); then
    fail "unexpected argument '${positional[2]}'; options start with --, and a command to run goes after --"
  fi
}

no_dry_run_in() {  # COMMAND's words: a --dry-run there would not stop gcloud
  local word
  for word in "$@"; do
    if [[ $word == --dry-run ]]; then
      fail "--dry-run after -- would be COMMAND's, and gcloud would really run; put it before --: tpu_vm.sh ${COMMAND:-run} ${NAME:-NAME} ... --dry-run -- ..."
    fi
  done
}

dry_run_env() {  # TPU_VM_DRY_RUN=1 is --dry-run for every command of a shell session
  case ${TPU_VM_DRY_RUN:-} in
    ""|0) ;;
    1) DRY_RUN=1 ;;
    *) fail "TPU_VM_DRY_RUN=$TPU_VM_DRY_RUN is not 0 or 1; write TPU_VM_DRY_RUN=1 for a dry run, or unset it" ;;
  esac
}

set_value() {
  if [[ -z $2 ]]; then fail "$1 needs a value: write $1=VALUE"; fi
  SEEN+=("$1")
  case $1 in
    --zone) ZONE=$2 ;;
    --type) TYPE=$2 ;;
    --engine) ENGINE=$2 ;;
    --version) VERSION=$2 ;;
    --project) PROJECT=$2 ;;
    --worker) WORKER=$2 ;;
    --dir) DIR=${2#\~/} ;;  # the VMs' home is where ssh and scp start anyway
    --env) ENVS+=("$2") ;;
    --slices)
      if ! [[ $2 =~ ^[1-9][0-9]*$ ]]; then fail "--slices=$2 is not a number of slices; write --slices=N with N of 1 or more"; fi
      SLICES=$2 ;;
  esac
}

check() {  # the command exists, takes the options given, and has what it needs
  local takes
  case $COMMAND in
    create) takes="--zone --type --engine --version --spot --reserved --slices" ;;
    delete) takes="--zone --spot --reserved --slices" ;;
    ssh) takes="--zone --worker" ;;
    copy) takes="--zone --dir --install --slices" ;;
    run) takes="--zone --dir --worker --tf-pod --env --slices" ;;
    "") fail "no command; write tpu_vm.sh create|delete|ssh|copy|run NAME --zone=ZONE ... (see --help)" ;;
    *) fail "unknown command '$COMMAND'; use one of create, delete, ssh, copy, run (see --help)" ;;
  esac
  takes+=" --project"
  local option
  for option in ${SEEN[@]+"${SEEN[@]}"}; do
    if [[ " $takes " != *" $option "* ]]; then
      fail "$COMMAND does not take $option; it takes ${takes// /, } and --dry-run"
    fi
  done
  local name_re='^[a-z]([-a-z0-9]*[a-z0-9])?$'
  if [[ -z $NAME ]]; then
    fail "$COMMAND needs the TPU's name: write tpu_vm.sh $COMMAND NAME --zone=ZONE ..."
  elif ! [[ $NAME =~ $name_re ]]; then
    fail "'$NAME' is not a TPU name; use lowercase letters, digits and dashes, e.g. my-tpu"
  fi
  if [[ -z $ZONE ]]; then
    fail "$COMMAND needs the TPU's zone: add --zone=ZONE, e.g. --zone=us-central2-b"
  fi
  if [[ $COMMAND == create ]]; then
    local type_re='^[a-z0-9]+-[0-9]+$'
    if [[ -z $TYPE ]]; then
      fail "create needs the slice type: add --type=TYPE, e.g. --type=v4-32"
    elif ! [[ $TYPE =~ $type_re ]]; then
      fail "--type=$TYPE is not an accelerator type; write e.g. --type=v4-32, v5litepod-16 or v5p-64"
    elif [[ ${TYPE%-*} == v5e ]]; then
      fail "gcloud names v5e slices v5litepod: write --type=v5litepod-${TYPE##*-}"
    elif [[ -z $(runtime_row "$TYPE") ]]; then
      fail "--type=$TYPE is not a generation this script covers; use v2, v3, v4, v5litepod (v5e), v5p or v6e (TPU7x and later are not in the Cloud TPU API)"
    fi
    if [[ $ENGINE != tf && $ENGINE != jax ]]; then
      fail "--engine=$ENGINE is not an engine; write --engine=tf or --engine=jax"
    fi
    if (( SLICES > 1 )) && [[ " $MULTISLICE " != *" ${TYPE%-*} "* ]]; then
      fail "--slices=$SLICES: Cloud TPU offers multislice on v4 and later (v4, v5litepod, v5p, v6e), not ${TYPE%-*}; create one slice without --slices"
    fi
    if (( SLICES > 1 )) && [[ $ENGINE == tf && -z $VERSION ]]; then
      fail "--slices=$SLICES needs the jax engine (TPUStrategy drives one slice): add --engine=jax"
    fi
  fi
  if (( SPOT && RESERVED )); then
    fail "--spot and --reserved ask for different capacity; give one of them"
  fi
  if (( TF_POD && SLICES > 1 )); then
    fail "--tf-pod runs one TensorFlow client on one slice; multislice runs the jax engine on every host: leave out --tf-pod"
  fi
  if [[ -n $WORKER && ! $WORKER =~ ^(all|[0-9]+)$ ]]; then
    fail "--worker=$WORKER is not a worker; write --worker=N (0 is the first) or --worker=all"
  fi
  if [[ $COMMAND == ssh && $WORKER == all ]]; then
    fail "ssh opens one worker; write --worker=N, or use run to reach them all"
  fi
  if (( TF_POD )) && [[ -n $WORKER ]]; then
    fail "--tf-pod runs on worker 0; leave out --worker=$WORKER"
  fi
  local env_re='^[A-Za-z_][A-Za-z0-9_]*='
  local env
  for env in ${ENVS[@]+"${ENVS[@]}"}; do
    if ! [[ $env =~ $env_re ]]; then fail "--env=$env is not a variable; write --env=NAME=VALUE"; fi
  done
  if [[ $COMMAND == run ]] && (( ${#REMOTE[@]} == 0 )); then
    fail "run needs the command after --: write tpu_vm.sh run $NAME --zone=$ZONE -- python3 -m tpu_keras.train ..."
  fi
  if [[ $COMMAND != run ]] && (( HAVE_REMOTE )); then
    fail "only run takes a command after --; leave it out of $COMMAND"
  fi
}

main() {
  if (( $# == 0 )); then usage; exit 0; fi
  parse "$@"
  dry_run_env
  check
  "cmd_$COMMAND"
}

main "$@"
