#!/usr/bin/env bash
# test-cluster.sh -- a real, single-host Slurm test cluster for hetseq_hpc's tests and CI.
#
#   scripts/test-cluster.sh start    # install (if needed) + start; last stdout line: export SLURM_CONF=...
#   scripts/test-cluster.sh status   # daemons + sinfo; exit 0 if up, 1 if not
#   scripts/test-cluster.sh stop     # cancel jobs, stop only the daemons we started, undo /etc/hosts
#   scripts/test-cluster.sh link n3 down|up|1gbit|none   # netns mode: cut, restore, shape a link
#
# Layout: one slurmctld and four emulated slurmd (`slurmd -N n1` ... `n4`, Debian's slurmd is
# built with multiple-slurmd support) on this host:
#     partition a100 = n[1-2], each with 2 fake GPUs gpu:a100
#     partition v100 = n[3-4], each with 2 fake GPUs gpu:v100
# Everything (configs, state, spool, logs, pid files, fake GPU devices) lives under
# ${HETSEQ_TESTCLUSTER_DIR:-/tmp/hetseq-testcluster}. Nothing outside it is touched except:
#   - the packages slurm-wlm + munge (installed with apt-get if slurmctld is missing),
#   - munged (started only if no munged answers; stopped on `stop` only if we started it and
#     no other Slurm on this host still uses it: another test cluster then takes it over),
#   - /etc/hosts: lines for n1..n4 tagged with our state directory, added on start and removed
#     (exactly those) on stop.
#
# Several clusters on one host (two clones running scripts/run-tests.sh, two users): give each
# its own state directory. Each start picks free ports (unless set below) and records them in
# its own slurm.conf; `stop` touches only the daemons, jobs and /etc/hosts lines of its own
# directory. scripts/run-tests.sh starts its own cluster in a fresh directory for every run.
#
# Exit codes: 0 ok; 1 failure (cluster did not come up, bad usage, ...);
#             3 the cluster cannot run here (not root, no apt-get, install failed, no mknod):
#               a one-line reason is printed on stderr so tests can skip with it.
#
# Environment knobs:
#   HETSEQ_TESTCLUSTER_DIR              state directory        (default /tmp/hetseq-testcluster)
#   HETSEQ_TESTCLUSTER_TIMEOUT          seconds to wait for the cluster to come up (default 60)
#   HETSEQ_TESTCLUSTER_CTLD_PORT        slurmctld port          (default auto: a free port)
#   HETSEQ_TESTCLUSTER_SLURMD_PORT_BASE slurmd of nK listens on BASE+K (default auto: free)
#   HETSEQ_TESTCLUSTER_EDIT_HOSTS       1 (default): add n1..n4 to /etc/hosts; 0: don't
#   HETSEQ_TESTCLUSTER_NETNS            1: every node in its own network namespace with its own
#                                       address on a bridge (nodes c<TAG>n1..4; section "netns")
#   HETSEQ_TESTCLUSTER_LINKS            netns mode: shaped links, e.g. n1=10gbit,n3=1gbit (tbf)
#   HETSEQ_TESTCLUSTER_SLURMD_TIMEOUT   slurm.conf's SlurmdTimeout, s (default 15; Slurm's own
#                                       default, as on most clusters, is 300): a node silent
#                                       longer is DOWN and its jobs' steps end
#
# Progress messages go to stderr; stdout of `start` is only the `export SLURM_CONF=...` line,
# so both `eval "$(scripts/test-cluster.sh start)"` and `... start | tail -n1` work.
set -euo pipefail

PROG=${0##*/}
DIR=${HETSEQ_TESTCLUSTER_DIR:-/tmp/hetseq-testcluster}
TIMEOUT=${HETSEQ_TESTCLUSTER_TIMEOUT:-60}
CTLD_PORT=${HETSEQ_TESTCLUSTER_CTLD_PORT:-auto}
SLURMD_PORT_BASE=${HETSEQ_TESTCLUSTER_SLURMD_PORT_BASE:-auto}
EDIT_HOSTS=${HETSEQ_TESTCLUSTER_EDIT_HOSTS:-1}
SLURMD_TIMEOUT=${HETSEQ_TESTCLUSTER_SLURMD_TIMEOUT:-15}

EXIT_UNAVAILABLE=3
NODES=(n1 n2 n3 n4)
# Network-namespace mode (HETSEQ_TESTCLUSTER_NETNS=1 at start; recorded in $NETNS_RECORD so
# that status/stop/link know it): every node's slurmd in its own namespace, see "netns" below.
NETNS_WANTED=${HETSEQ_TESTCLUSTER_NETNS:-0}
NETNS=0               # 1 once this directory's cluster is (being) started in netns mode
LINKS=${HETSEQ_TESTCLUSTER_LINKS:-}
# Every name of this cluster's network objects starts with hsq<TAG>, TAG derived from the
# state directory (5 digits of its CRC): namespaces hsq<TAG>n<K>, bridge hsq<TAG>br, the
# root-side veths hsq<TAG>v<K> and their peers hsq<TAG>p<K> (inside the namespaces).
NETNS_TAG=$(printf '%05d' "$(( $(printf '%s' "$DIR" | cksum | cut -d' ' -f1) % 100000 ))")
NETNS_PREFIX=hsq$NETNS_TAG
NETNS_SUBNET=""       # 10.231.<idx> of this cluster, picked at start (under $LOCK) and recorded
NETNS_RECORD=$DIR/run/ours/netns.env
CONF_DIR=$DIR/etc
CONF=$CONF_DIR/slurm.conf
RUN=$DIR/run          # pid files written by the Slurm daemons themselves
OURS=$DIR/run/ours    # what *we* started / changed: <daemon>.pid, hosts flags
HOSTS_TAG="# hetseq-testcluster"          # every test cluster's /etc/hosts lines carry it
HOSTS_MARK="$HOSTS_TAG $DIR"              # ... followed by the cluster's state directory
# held while a start picks its ports and job-id slot and starts slurmctld, and while /etc/hosts
# is edited: two clusters starting at once must not pick the same ports or slot
LOCK=/tmp/hetseq-testcluster.lock
# Job ids: a job's rendezvous port is derived from its id (15000 + id % 20000,
# hetseq_hpc.env.world) and every emulated node is this host, so two clusters whose job ids
# overlap would give two jobs the same port. Each cluster starts its ids in a slot no other
# running test cluster uses: FirstJobId = 1 + slot x JOB_ID_SLOT.
JOB_ID_SLOT=2500
JOB_ID_SLOTS=8
FIRST_JOB_ID=1

# Daemons and client commands live in /usr/sbin and /usr/bin.
export PATH=$PATH:/usr/local/sbin:/usr/sbin:/sbin
# Every daemon we start and every client command below reads this config.
export SLURM_CONF=$CONF

# --------------------------------------------------------------------------- helpers

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { local code=$1; shift; log "$*"; exit "$code"; }

usage() {
    cat <<EOF
Usage: $PROG start|stop|status|link NODE down|up|RATE|none|--help

A single-host Slurm test cluster: slurmctld + 4 emulated slurmd (n1..n4), partitions
a100 = n[1-2] (gres gpu:a100:2 per node) and v100 = n[3-4] (gres gpu:v100:2 per node).

  start    install slurm-wlm + munge if needed (root, apt-get), start munged (if not
           running), slurmctld and the 4 slurmd on free ports, wait until every node is
           idle. A fresh cluster each time (job ids restart at FirstJobId). On a running cluster (of
           this state directory): just reports it.
           Last stdout line:  export SLURM_CONF=$CONF
           (also written to $DIR/env.sh). Use:
               eval "\$($0 start | tail -n1)"
  stop     cancel all jobs, stop the daemons this script started (by recorded PID),
           remove the /etc/hosts lines it added. Logs stay in $DIR/log.
  status   show the daemons and sinfo; exit 0 if the cluster is up, 1 if not.
  link     netns mode only: cut (down) or restore (up) node NODE's link (n1..n4), or shape
           it to RATE (e.g. 1gbit, 100mbit; tbf both ways) or unshape it (none).

HETSEQ_TESTCLUSTER_NETNS=1 at start: every node's slurmd in its own network namespace with
its own address on a bridge made here (nodes c<TAG>n1..4, TAG from the state directory);
HETSEQ_TESTCLUSTER_LINKS=n1=10gbit,n3=1gbit shapes links. Exit 3 where namespaces are
not allowed. stop removes this cluster's namespaces, links and bridge.

State directory: \$HETSEQ_TESTCLUSTER_DIR (now: $DIR). Another directory is another
cluster: HETSEQ_TESTCLUSTER_DIR=/tmp/my-cluster $0 start|stop|status.
Exit codes: 0 ok, 1 error, 3 cannot run here (not root / cannot install); reason on stderr.
EOF
}

now() { printf '%s' "${EPOCHREALTIME/,/.}"; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# wait_until SECONDS CMD...: poll CMD every 0.1 s; succeed as soon as it does, fail on timeout.
wait_until() {
    local deadline=$(( SECONDS + $1 )); shift
    until "$@"; do
        (( SECONDS < deadline )) || return 1
        sleep 0.1
    done
}

# pid_alive PID: the process exists and is not a zombie. Daemons we TERM stay zombies until
# PID 1 reaps them (seen: ~2 s); they are dead for our purposes.
pid_alive() {
    local stat rest state
    [[ $1 =~ ^[0-9]+$ ]] || return 1
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    rest=${stat##*) }          # the comm field may contain spaces; the state follows ") "
    state=${rest%% *}
    [[ $state != Z && $state != X ]]
}

# pid_is PID COMM: PID is alive and its command name is COMM (guards against PID reuse).
pid_is() {
    pid_alive "$1" && [[ "$(cat "/proc/$1/comm" 2>/dev/null)" == "$2" ]]
}

# pid_has_our_conf PID: the process runs with our SLURM_CONF in its environment. Our daemons
# were started with it, and slurmstepd inherits it from slurmd; this tells our Slurm
# processes apart from any other cluster's on the same host.
pid_has_our_conf() {
    tr '\0' '\n' 2>/dev/null < "/proc/$1/environ" | grep -qxF "SLURM_CONF=$CONF"
}

# Our record of the daemons we started: $OURS/<name>.pid (name = munged, slurmctld, slurmd-nK).
record_pid() { printf '%s\n' "$2" > "$OURS/$1.pid"; }
recorded_pid() { cat "$OURS/$1.pid" 2>/dev/null || true; }
daemon_comm() { case $1 in slurmd-*) echo slurmd ;; *) echo "$1" ;; esac; }
slurm_daemons() { local n; echo slurmctld; for n in "${NODES[@]}"; do echo "slurmd-$n"; done; }

# ours_alive NAME: the daemon we recorded under NAME is still running.
ours_alive() {
    local pid; pid=$(recorded_pid "$1")
    [[ -n $pid ]] && pid_is "$pid" "$(daemon_comm "$1")"
}

node_index() { echo "${1##*n}"; }
# Each emulated node gets its own loopback address (all of 127.0.0.0/8 is loopback on Linux):
# n1 -> 127.0.0.11, ..., n4 -> 127.0.0.14; in netns mode its namespace's address on the
# cluster's bridge, <subnet>.11 ... <subnet>.14.
node_addr() {
    if [[ -n $NETNS_SUBNET ]]; then echo "$NETNS_SUBNET.$(( 10 + $(node_index "$1") ))"
    else echo "127.0.0.$(( 10 + $(node_index "$1") ))"
    fi
}
node_port() { echo "$(( SLURMD_PORT_BASE + $(node_index "$1") ))"; }

check_settings() {
    [[ $DIR == /* ]] || die 1 "HETSEQ_TESTCLUSTER_DIR must be an absolute path (got '$DIR')"
    [[ $DIR != / && $DIR != *[[:space:]]* ]] || die 1 "HETSEQ_TESTCLUSTER_DIR must not be / or contain spaces (got '$DIR')"
    [[ $TIMEOUT =~ ^[0-9]+$ ]] || die 1 "HETSEQ_TESTCLUSTER_TIMEOUT must be a number of seconds"
    [[ $CTLD_PORT == auto || $CTLD_PORT =~ ^[0-9]+$ ]] ||
        die 1 "HETSEQ_TESTCLUSTER_CTLD_PORT must be a port number or auto (got '$CTLD_PORT')"
    [[ $SLURMD_PORT_BASE == auto || $SLURMD_PORT_BASE =~ ^[0-9]+$ ]] ||
        die 1 "HETSEQ_TESTCLUSTER_SLURMD_PORT_BASE must be a number or auto (got '$SLURMD_PORT_BASE')"
    [[ $NETNS_WANTED == 0 || $NETNS_WANTED == 1 ]] ||
        die 1 "HETSEQ_TESTCLUSTER_NETNS must be 0 or 1 (got '$NETNS_WANTED')"
    [[ $SLURMD_TIMEOUT =~ ^[0-9]+$ ]] && (( SLURMD_TIMEOUT >= 5 )) ||
        die 1 "HETSEQ_TESTCLUSTER_SLURMD_TIMEOUT must be a whole number of seconds >= 5 (got '$SLURMD_TIMEOUT'), e.g. 300"
}

# ----------------------------------------------------------------- installation

REQUIRED_CMDS=(slurmctld slurmd sinfo squeue scontrol scancel sbatch srun munged munge unmunge)

missing_cmds() {
    local c out=()
    for c in "${REQUIRED_CMDS[@]}"; do command -v "$c" >/dev/null 2>&1 || out+=("$c"); done
    echo "${out[*]}"
}

# Is some apt-get/dpkg running right now (e.g. the machine's provisioning install)?
apt_busy() {
    local d comm
    for d in /proc/[0-9]*; do
        comm=$(cat "$d/comm" 2>/dev/null) || continue
        case $comm in apt-get|apt|dpkg|unattended-upgr) return 0 ;; esac
    done
    return 1
}

# If another apt-get/dpkg run is under way (a machine's provisioning, say), wait for it rather
# than race it for the dpkg lock: until Slurm is there, no apt/dpkg has run for 15 s, or 10 min.
wait_for_running_apt() {
    local deadline=$(( SECONDS + 600 )) idle_since=$SECONDS
    apt_busy || return 0
    log "an apt-get/dpkg run is in progress; waiting for it"
    while (( SECONDS < deadline )); do
        [[ -z "$(missing_cmds)" ]] && return 0
        if apt_busy; then idle_since=$SECONDS
        elif (( SECONDS - idle_since >= 15 )); then return 0
        fi
        sleep 1
    done
    log "still waiting for apt after 600s: trying to install anyway"
}

ensure_installed() {
    [[ -z "$(missing_cmds)" ]] && return 0
    wait_for_running_apt
    [[ -z "$(missing_cmds)" ]] && return 0

    (( EUID == 0 )) || die "$EXIT_UNAVAILABLE" "Slurm is not installed (missing: $(missing_cmds)) and installing it needs root"
    command -v apt-get >/dev/null 2>&1 || die "$EXIT_UNAVAILABLE" "Slurm is not installed (missing: $(missing_cmds)) and there is no apt-get to install it"

    mkdir -p "$DIR/log"
    local aptlog=$DIR/log/apt-install.log t0; t0=$(now)
    log "installing slurm-wlm and munge with apt-get (log: $aptlog)"
    # DPkg::Lock::Timeout: if another apt run holds the lock anyway, wait for it instead of failing.
    if ! { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update &&
           DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y \
               --no-install-recommends slurm-wlm munge; } >"$aptlog" 2>&1; then
        die "$EXIT_UNAVAILABLE" "apt-get install slurm-wlm munge failed: $(tail -n1 "$aptlog")"
    fi
    [[ -z "$(missing_cmds)" ]] || die "$EXIT_UNAVAILABLE" "after apt-get install still missing: $(missing_cmds)"
    log "installed in $(elapsed "$t0")s"
}

# ------------------------------------------------------------------- configuration

write_slurm_conf() {
    local n a100=() v100=() ctld_host=localhost
    # netns mode: the nodes reach the controller at the bridge's address
    if [[ -n $NETNS_SUBNET ]]; then ctld_host="localhost($(ctld_addr))"; fi
    cat > "$CONF" <<EOF
# Generated by scripts/test-cluster.sh -- single-host Slurm test cluster for hetseq_hpc.
# Do not edit: rewritten on every start.
ClusterName=hetseqtest
# The controller runs on this host; clients and slurmds reach it at $(ctld_addr):$CTLD_PORT.
SlurmctldHost=$ctld_host
SlurmctldPort=$CTLD_PORT
# Everything runs as root (the script is run as root; no slurm user setup needed).
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Job-step credential lifetime (default 120 s, minimum 5). It also sets how long a REQUEUED job
# waits before it may start again (EligibleTime = requeue time + cred_expire + 1): with the
# default a requeued job sits PENDING (Reason=BeginTime) for ~2 min. 10 s keeps requeue tests
# fast and still leaves ample time for a step launch on this host.
AuthInfo=cred_expire=10
MailProg=/bin/true

# All state under $DIR. StateSaveLocation is wiped by every 'start', so each start is a
# fresh cluster and job ids restart at FirstJobId: 1, or the first id of a slot no other test
# cluster on this host uses (job ids set the jobs' rendezvous ports).
FirstJobId=$FIRST_JOB_ID
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

# No systemd, no cgroup plugins: track processes by parent pid, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Consumable resources incl. GRES (needed for --gres / --gpus-per-node).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Heterogeneous jobs are started ONLY by the backfill scheduler. Its default interval
# (bf_interval=30) delays a het job by ~20-30 s; 1 s makes het jobs start at once.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
# No accounting (no slurmdbd): sacct reports "accounting storage is disabled".
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
# A node that was DOWN comes back as soon as its slurmd registers with a valid config.
ReturnToService=2
# Use the CPUs/RealMemory declared below instead of this host's real hardware, so four
# 4-CPU nodes can be emulated on a 2-core machine ("Node configuration differs from
# hardware" in the logs is expected).
SlurmdParameters=config_overrides
GresTypes=gpu
# A node whose slurmd does not answer for SlurmdTimeout s is marked DOWN; slurmctld checks
# them every SlurmdTimeout/3 s. 15 s (default 300) is ample for local daemons and makes the
# checks frequent, which matters for het jobs: the backfill scheduler (the only one that
# starts het jobs) skips its cycle unless some job/node/partition changed, and a job merely
# reaching its EligibleTime (a requeued job) is no change; node pings/registrations are.
# Measured: a requeued het job restarts 11-19 s after 'scontrol requeue' (22-38 s with
# SlurmdTimeout=60); any job update after EligibleTime starts it within ~1 s.
# HETSEQ_TESTCLUSTER_SLURMD_TIMEOUT sets it (scripts/partition_drills.py: Slurm's default 300).
SlurmdTimeout=$SLURMD_TIMEOUT
InactiveLimit=0
# Finished jobs stay visible to squeue/scontrol for 5 min (an squeue-based job watcher
# relies on seeing COMPLETED/FAILED/CANCELLED states without sacct).
MinJobAge=300
# Seconds between SIGTERM and SIGKILL when a job is cancelled or times out.
KillWait=5
# Do not kill the rest of a step when its first task exits.
Waittime=0

# Four emulated nodes: each has its own slurmd (slurmd -N nK) on its own port, and its own
# loopback address so that addresses tell nodes apart. NodeHostname=localhost: all run here.
EOF
    for n in "${NODES[@]}"; do
        local gpu=a100
        (( $(node_index "$n") > 2 )) && gpu=v100
        if [[ $gpu == a100 ]]; then a100+=("$n"); else v100+=("$n"); fi
        printf 'NodeName=%s NodeHostname=localhost NodeAddr=%s Port=%s CPUs=4 RealMemory=4000 Gres=gpu:%s:2 State=UNKNOWN\n' \
            "$n" "$(node_addr "$n")" "$(node_port "$n")" "$gpu" >> "$CONF"
    done
    local IFS=,
    cat >> "$CONF" <<EOF
# Two GPU kinds, two nodes each. Het-job components were never seen sharing a node (a job
# whose components need more nodes than a partition has stays PENDING): size test jobs so
# each component gets its own nodes. v100 has a time limit (1 day) so that the pre-submission
# check of cluster.timeout_min against MaxTime runs against a real sinfo.
PartitionName=a100 Nodes=${a100[*]} Default=YES MaxTime=INFINITE State=UP
PartitionName=v100 Nodes=${v100[*]} MaxTime=1-00:00:00 State=UP
EOF
}

# gres.conf must sit next to slurm.conf (Slurm looks for it in SLURM_CONF's directory).
write_gres_conf() {
    cat > "$CONF_DIR/gres.conf" <<EOF
# Generated by scripts/test-cluster.sh. Fake GPUs: gres/gpu drops GPUs without File= (the node
# then drains) and rejects regular files, so File= points at char devices made with
# 'mknod FILE c 1 3' (same device as /dev/null). Tasks still get CUDA_VISIBLE_DEVICES,
# SLURM_JOB_GPUS and SLURM_GPUS_ON_NODE. Every node uses the same two device files.
AutoDetect=off
NodeName=${NODES[0]},${NODES[1]} Name=gpu Type=a100 File=$DIR/dev/nvidia[0-1]
NodeName=${NODES[2]},${NODES[3]} Name=gpu Type=v100 File=$DIR/dev/nvidia[0-1]
EOF
}

make_fake_gpus() {
    local i f
    mkdir -p "$DIR/dev"
    for i in 0 1; do
        f=$DIR/dev/nvidia$i
        [[ -c $f ]] && continue
        rm -f "$f"
        mknod "$f" c 1 3 2>/dev/null ||
            die "$EXIT_UNAVAILABLE" "cannot create fake GPU device with 'mknod $f c 1 3' (no CAP_MKNOD?)"
    done
}

# Fresh cluster: wipe everything the previous run left, except the fake devices.
prepare_dirs() {
    local d
    for d in etc state spool log run; do rm -rf "${DIR:?}/$d"; done
    mkdir -p "$CONF_DIR" "$DIR/state" "$DIR/log" "$RUN" "$OURS"
    for d in "${NODES[@]}"; do mkdir -p "$DIR/spool/$d"; done
}

write_env_sh() {
    printf 'export SLURM_CONF=%q\n' "$CONF" > "$DIR/env.sh"
}

# --------------------------------------------------------------------- /etc/hosts
#
# Choice: BOTH a per-node loopback NodeAddr (127.0.0.11..14, in slurm.conf: that is how
# slurmctld/srun reach each slurmd, and it works without any name resolution) AND /etc/hosts
# entries "127.0.0.1K nK". The latter are needed because programs inside a job see node names,
# not addresses: a PyTorch rendezvous uses MASTER_ADDR = first node of the het group 0 nodelist,
# e.g. "n1", and must resolve it (`hostname` inside a job is this host's name for every node;
# SLURMD_NODENAME is nK). We add exactly our tagged lines on start and remove exactly them on
# stop. The file is rewritten in place (`printf > /etc/hosts`, never mv): it may be a bind mount.
# A name that /etc/hosts already defines (not by us) is left alone.

# Print /etc/hosts content exactly, including whether it ends with a newline.
read_hosts() { local c; c=$(cat /etc/hosts; printf x); printf '%s' "${c%x}"; }

# hosts_defines NAME: a line of /etc/hosts that is not a test cluster's maps NAME. Another test
# cluster's lines map the same names to the same addresses: we add our own next to them, so
# that each cluster's stop removes only its own and the names keep resolving for the other.
hosts_defines() {
    awk -v n="$1" -v t="$HOSTS_TAG" 'index($0, t) { next }
        { sub(/#.*/, ""); for (i = 2; i <= NF; i++) if ($i == n) f = 1 } END { exit !f }' /etc/hosts
}

# with_lock CMD...: run CMD holding $LOCK (two clusters starting or stopping at once must not
# both rewrite /etc/hosts from the same old content, nor pick the same ports or job-id slot).
with_lock() {
    local rc=0
    { flock -w 60 9 || log "warning: $LOCK is held for 60 s: going on without it"
      "$@" || rc=$?; } 9>>"$LOCK"
    return "$rc"
}

hosts_remove() { with_lock hosts_remove_locked; }
hosts_add() { with_lock hosts_add_locked; }

hosts_remove_locked() {
    [[ -f /etc/hosts ]] || return 0
    local cur new
    cur=$(read_hosts; printf x); cur=${cur%x}
    # drop lines ending with our tag (fixed-string suffix match, no regex)
    new=$(printf '%s' "$cur" | awk -v m="$HOSTS_MARK" '
        { l = length($0); k = length(m) }
        l >= k && substr($0, l - k + 1) == m { next }
        { print }'; printf x)
    new=${new%x}
    # awk ends every line with a newline: keep a last line without one as it was; and if start
    # appended a newline to a file that lacked one, take that back too.
    if [[ -n $cur && ${cur: -1} != $'\n' ]] || [[ -f $OURS/hosts-added-newline ]]; then
        new=${new%$'\n'}
    fi
    if [[ $new != "$cur" ]]; then
        printf '%s' "$new" > /etc/hosts || { log "warning: could not rewrite /etc/hosts"; return 0; }
        log "removed our n1..n4 lines from /etc/hosts"
    fi
    rm -f "$OURS/hosts-added-newline"
}

hosts_add_locked() {
    [[ $EDIT_HOSTS == 1 ]] || { log "HETSEQ_TESTCLUSTER_EDIT_HOSTS=0: not adding n1..n4 to /etc/hosts"; return 0; }
    hosts_remove_locked   # leftovers of an earlier run that was not stopped
    local n lines="" cur
    for n in "${NODES[@]}"; do
        if hosts_defines "$n"; then
            log "warning: /etc/hosts already defines $n; leaving that entry alone"
            continue
        fi
        lines+="$(node_addr "$n") $n $HOSTS_MARK"$'\n'
    done
    [[ -n $lines ]] || return 0
    cur=$(read_hosts; printf x); cur=${cur%x}
    if [[ -n $cur && ${cur: -1} != $'\n' ]]; then
        cur+=$'\n'
        touch "$OURS/hosts-added-newline"
    fi
    if ! printf '%s%s' "$cur" "$lines" > /etc/hosts 2>/dev/null; then
        rm -f "$OURS/hosts-added-newline"
        log "warning: /etc/hosts is not writable: n1..n4 will not resolve inside jobs"
        return 0
    fi
}

# -------------------------------------------------------------------------- munge

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_works; then
        log "munged already running (not started by us; 'stop' leaves it alone)"
        return 0
    fi
    [[ -s /etc/munge/munge.key ]] || die 1 "/etc/munge/munge.key is missing (Debian's munge package creates it)"
    install -d -o munge -g munge /run/munge
    if ! runuser -u munge -- /usr/sbin/munged; then
        # another test cluster starting at the same moment may have won the race
        if wait_until 5 munge_works; then
            log "munged was started meanwhile by someone else; using it"
            return 0
        fi
        die 1 "munged failed to start (see /var/log/munge/munged.log)"
    fi
    local pid=""
    wait_until 10 test -s /run/munge/munged.pid || true
    pid=$(cat /run/munge/munged.pid 2>/dev/null || true)
    if pid_is "$pid" munged; then
        record_pid munged "$pid"
        log "started munged (pid $pid)"
    fi
    wait_until 10 munge_works || die 1 "munged started but 'munge -n | unmunge' fails"
}

# ----------------------------------------------------------------------- daemons

# port_in_use PORT: something accepts connections on 127.0.0.1:PORT.
port_in_use() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

our_ports() { local n; echo "$CTLD_PORT"; for n in "${NODES[@]}"; do node_port "$n"; done; }

ports_free() {
    local p seen=" "
    for p in $(our_ports); do
        [[ $seen == *" $p "* ]] && return 1   # the ctld port among the slurmd ports
        seen+="$p "
        port_in_use "$p" && return 1
    done
    return 0
}

# pick_ports: the ports set by the environment must be free; "auto" ones are picked at random in
# 10000-14999 (below the jobs' rendezvous ports, 15000 + job id % 20000, and Linux's ephemeral
# range) until all five are free, so that clusters of several clones or users never share one.
pick_ports() {
    local want_ctld=$CTLD_PORT want_base=$SLURMD_PORT_BASE try base
    if [[ $want_ctld != auto && $want_base != auto ]]; then
        ports_free && return 0
        die 1 "a port of $(our_ports | tr '\n' ' ')is already in use (another Slurm cluster on" \
            "this host?): set HETSEQ_TESTCLUSTER_CTLD_PORT / HETSEQ_TESTCLUSTER_SLURMD_PORT_BASE" \
            "to free ports, or leave them unset (auto)"
    fi
    for try in $(seq 1 100); do
        base=$(( 10000 + (RANDOM % 499) * 10 ))
        [[ $want_ctld == auto ]] && CTLD_PORT=$base
        [[ $want_base == auto ]] && SLURMD_PORT_BASE=$base
        ports_free && { log "ports: slurmctld $CTLD_PORT, slurmd $(( SLURMD_PORT_BASE + 1 ))-$(( SLURMD_PORT_BASE + ${#NODES[@]} ))"; return 0; }
    done
    die 1 "found no free ports for slurmctld and 4 slurmd after $try tries"
}

# Slurm daemons daemonize themselves and write their pid file (SlurmctldPidFile, SlurmdPidFile).
# adopt NAME PIDFILE: wait for that pid file and record the PID as one of ours.
adopt() {
    local name=$1 pidfile=$2 pid
    if ! wait_until 10 test -s "$pidfile"; then log "$name wrote no pid file $pidfile"; return 1; fi
    pid=$(cat "$pidfile")
    pid_is "$pid" "$(daemon_comm "$name")" || { log "$name (pid $pid) died right after starting"; return 1; }
    record_pid "$name" "$pid"
}

ctld_ping() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
all_idle() { [[ "$(sinfo -h -N -o %T 2>/dev/null | sort -u)" == idle ]]; }

dump_logs() {
    local f
    log "---- sinfo -R ----"; sinfo -R >&2 2>&1 || true
    for f in "$DIR"/log/slurmctld.log "$DIR"/log/slurmd-*.log; do
        [[ -f $f ]] || continue
        log "---- tail $f ----"; tail -n 20 "$f" >&2
    done
}

# all_ours_up: every Slurm daemon we recorded is alive and the controller answers.
all_ours_up() {
    local d
    for d in $(slurm_daemons); do ours_alive "$d" || return 1; done
    ctld_ping
}

any_ours_alive() {
    local d
    for d in $(slurm_daemons) munged; do ours_alive "$d" && return 0; done
    return 1
}

# ------------------------------------------------------------------------- netns
#
# HETSEQ_TESTCLUSTER_NETNS=1: each emulated node runs its slurmd in its own network namespace
# hsq<TAG>n<K>, joined by a veth pair (hsq<TAG>v<K> here, hsq<TAG>p<K> inside, address
# <subnet>.1<K>/24) to a bridge hsq<TAG>br in this namespace, which holds <subnet>.1: the
# controller's address. The bridge's alias is the state directory: the mark that these names
# are this cluster's (stop removes nothing whose bridge names another directory). The node
# names are c<TAG>n1..c<TAG>n4, not n1..n4: /etc/hosts maps every test cluster's names, and
# another cluster's n1 is 127.0.0.11. The subnet is 10.231.<idx>.0/24, idx taken from the TAG
# on, the first that no address or route of this host uses (picked under $LOCK, recorded).
# Links are shaped with tbf on both ends of a veth (a symmetric link; HETSEQ_TESTCLUSTER_LINKS
# at start, or `link nK RATE`); `link nK down` sets the root end down: a partition.

ctld_addr() { if [[ -n $NETNS_SUBNET ]]; then echo "$NETNS_SUBNET.1"; else echo localhost; fi; }
ns_name() { echo "${NETNS_PREFIX}n$(node_index "$1")"; }
veth_root() { echo "${NETNS_PREFIX}v$(node_index "$1")"; }
veth_peer() { echo "${NETNS_PREFIX}p$(node_index "$1")"; }
BRIDGE=${NETNS_PREFIX}br
use_netns_nodes() { NODES=("c${NETNS_TAG}n1" "c${NETNS_TAG}n2" "c${NETNS_TAG}n3" "c${NETNS_TAG}n4"); }

# A started netns cluster of this directory: take its mode, node names and subnet.
load_netns_record() {
    [[ -f $NETNS_RECORD ]] || return 0
    local subnet
    subnet=$(sed -n 's/^NETNS_SUBNET=//p' "$NETNS_RECORD" | head -n1)
    [[ $subnet =~ ^10\.231\.[0-9]{1,3}$ ]] || { log "warning: ignoring malformed $NETNS_RECORD"; return 0; }
    NETNS=1
    NETNS_SUBNET=$subnet
    use_netns_nodes
}

# node_ref NAME: the node NAME names: nK (K = 1..4) or its full name; dies on anything else.
node_ref() {
    local n
    for n in "${NODES[@]}"; do
        if [[ $1 == "$n" || $1 == "n$(node_index "$n")" ]]; then echo "$n"; return 0; fi
    done
    die 1 "no node '$1' in this cluster: use n1..n4 (or ${NODES[*]})"
}

# rate_ok RATE: a tc rate with a unit, e.g. 100mbit, 1gbit, 10gbit.
rate_ok() { [[ $1 =~ ^[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)$ ]] && awk -v r="$1" 'BEGIN { exit !(r + 0 > 0) }'; }

# tbf_burst RATE: the bucket size in bytes: 1 ms of the rate, at least 128 KiB (a veth hands
# tbf GSO packets of up to 64 KiB; a bucket below a packet drops it). Small, so that a
# transfer of a few MB is not sped up by the bucket's first burst.
tbf_burst() {
    awk -v r="$1" 'BEGIN {
        n = r + 0; u = substr(r, length(n "") + 1)
        m = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : 1e9
        b = n * m / 8 / 1000; if (b < 131072) b = 131072; printf "%d", b }'
}

check_links() {
    local item node rate
    [[ -n $LINKS ]] || return 0
    [[ $NETNS == 1 ]] || die 1 "HETSEQ_TESTCLUSTER_LINKS='$LINKS' needs HETSEQ_TESTCLUSTER_NETNS=1 (links exist only between namespaces)"
    for item in ${LINKS//,/ }; do
        node=${item%%=*}; rate=${item#*=}
        [[ $item == *=* && $node =~ ^n[1-4]$ ]] && rate_ok "$rate" ||
            die 1 "HETSEQ_TESTCLUSTER_LINKS item '$item' is not nK=RATE (K 1..4, RATE like 1gbit, 100mbit): e.g. n1=10gbit,n3=1gbit"
    done
}

# shape NODE RATE|none: shape both ends of NODE's link to RATE with tbf, or remove the shaping.
shape() {
    local n=$1 rate=$2 burst
    if [[ $rate == none ]]; then
        tc qdisc del dev "$(veth_root "$n")" root 2>/dev/null || true
        tc -n "$(ns_name "$n")" qdisc del dev "$(veth_peer "$n")" root 2>/dev/null || true
        return 0
    fi
    burst=$(tbf_burst "$rate")
    tc qdisc replace dev "$(veth_root "$n")" root tbf rate "$rate" burst "$burst" latency 50ms &&
        tc -n "$(ns_name "$n")" qdisc replace dev "$(veth_peer "$n")" root tbf rate "$rate" burst "$burst" latency 50ms
}

subnet_used() {   # subnet_used IDX: an address or a route of this namespace is in 10.231.IDX.0/24
    ip -o -4 addr show | grep -qF " 10.231.$1." && return 0
    ip -4 route show | grep -q "^10\.231\.$1\.[0-9/]" && return 0
    return 1
}

bridge_owner() { ip -o link show dev "$BRIDGE" 2>/dev/null | sed -n 's/.* alias //p'; }
bridge_exists() { ip link show dev "$BRIDGE" >/dev/null 2>&1; }

# netns_bridge_locked (under $LOCK): pick a free subnet, make the bridge with its address and
# record the subnet. An error goes to stderr; returns 1, or 3 when namespaces are not allowed.
netns_bridge_locked() {
    local start idx try err
    if bridge_exists; then
        log "the network names $NETNS_PREFIX* of this state directory are in use by the test cluster of '$(bridge_owner)' (same CRC tag $NETNS_TAG): use another HETSEQ_TESTCLUSTER_DIR"
        return 1
    fi
    start=$(( 10#$NETNS_TAG % 250 + 1 ))
    for (( try = 0; try < 250; try++ )); do
        idx=$(( (start - 1 + try) % 250 + 1 ))
        subnet_used "$idx" || { NETNS_SUBNET=10.231.$idx; break; }
    done
    [[ -n $NETNS_SUBNET ]] || { log "no free subnet 10.231.x.0/24 on this host"; return 1; }
    if ! err=$(ip link add "$BRIDGE" type bridge 2>&1); then
        log "network namespaces are not allowed here: 'ip link add $BRIDGE type bridge' failed: $err"
        return 3
    fi
    printf 'NETNS_SUBNET=%s\n' "$NETNS_SUBNET" > "$NETNS_RECORD"
    ip link set dev "$BRIDGE" alias "$DIR" &&
        ip addr add "$NETNS_SUBNET.1/24" dev "$BRIDGE" &&
        ip link set dev "$BRIDGE" up
}

# netns_node NODE: its namespace, its veth pair on the bridge, its address; 3 if not allowed.
netns_node() {
    local n=$1 ns v p err
    ns=$(ns_name "$n"); v=$(veth_root "$n"); p=$(veth_peer "$n")
    if ! err=$(ip netns add "$ns" 2>&1); then
        log "network namespaces are not allowed here: 'ip netns add $ns' failed: $err"
        return 3
    fi
    ip link add "$v" type veth peer name "$p" &&
        ip link set dev "$p" netns "$ns" &&
        ip link set dev "$v" master "$BRIDGE" up &&
        ip -n "$ns" addr add "$(node_addr "$n")/24" dev "$p" &&
        ip -n "$ns" link set dev lo up &&
        ip -n "$ns" link set dev "$p" up
}

# netns_up: bridge, namespaces, links and their shaping; on failure removes what it made and
# exits (3 where namespaces are not allowed, with the reason).
netns_up() {
    local rc=0 n item err
    command -v ip >/dev/null 2>&1 || die "$EXIT_UNAVAILABLE" "network-namespace mode needs iproute2's 'ip', which is not installed"
    if [[ -n $LINKS ]] && ! command -v tc >/dev/null 2>&1; then
        die "$EXIT_UNAVAILABLE" "HETSEQ_TESTCLUSTER_LINKS needs iproute2's 'tc', which is not installed"
    fi
    use_netns_nodes
    with_lock netns_bridge_locked || rc=$?
    if (( rc == 0 )); then
        for n in "${NODES[@]}"; do netns_node "$n" || { rc=$?; break; }; done
    fi
    if (( rc == 0 )); then
        for item in ${LINKS//,/ }; do
            n=$(node_ref "${item%%=*}")
            if ! err=$(shape "$n" "${item#*=}" 2>&1); then
                log "cannot shape $n's link to ${item#*=} with tc tbf: $(printf '%s' "$err" | head -n1)"
                rc=1
                [[ $err == *"nknown"* ]] && rc=$EXIT_UNAVAILABLE   # no tbf in this kernel
                break
            fi
        done
    fi
    if (( rc != 0 )); then
        netns_down
        (( rc == EXIT_UNAVAILABLE )) && exit "$EXIT_UNAVAILABLE"
        exit 1
    fi
    log "netns: nodes ${NODES[*]} at $(node_addr "${NODES[0]}")..$(node_addr "${NODES[3]}"), controller at $(ctld_addr) (bridge $BRIDGE)${LINKS:+, links $LINKS}"
}

# netns_down: remove this cluster's namespaces, veths and bridge (by their names, derived from
# the state directory), unless the bridge names another state directory as its owner.
netns_down() {
    command -v ip >/dev/null 2>&1 || return 0
    local k owner removed=""
    if bridge_exists; then
        owner=$(bridge_owner)
        if [[ $owner != "$DIR" ]]; then
            log "leaving $NETNS_PREFIX* alone: its bridge belongs to the test cluster of '$owner'"
            return 0
        fi
    elif [[ ! -f $NETNS_RECORD ]] && ! ip netns list 2>/dev/null | grep -q "^${NETNS_PREFIX}n[1-4]\b"; then
        return 0
    fi
    for k in 1 2 3 4; do
        if ip netns list 2>/dev/null | grep -q "^${NETNS_PREFIX}n$k\b"; then
            ip netns del "${NETNS_PREFIX}n$k" 2>/dev/null && removed+=" ${NETNS_PREFIX}n$k"
        fi
        # a veth whose peer never reached its namespace goes with neither
        ip link del "${NETNS_PREFIX}v$k" 2>/dev/null && removed+=" ${NETNS_PREFIX}v$k"
    done
    bridge_exists && ip link del "$BRIDGE" 2>/dev/null && removed+=" $BRIDGE"
    rm -f "$NETNS_RECORD"
    [[ -z $removed ]] || log "removed network namespaces and links:$removed"
    return 0
}

netns_status() {
    local n state qdisc
    printf 'netns: subnet %s.0/24, bridge %s, controller at %s\n' "$NETNS_SUBNET" "$BRIDGE" "$(ctld_addr)"
    for n in "${NODES[@]}"; do
        state=$(ip -o link show dev "$(veth_root "$n")" 2>/dev/null | grep -o 'state [A-Z]*' || echo 'state MISSING')
        qdisc=$(tc qdisc show dev "$(veth_root "$n")" 2>/dev/null | grep -o 'tbf.*rate [^ ]*' | sed 's/.*rate /rate /' || true)
        printf '%-12s ns %-12s %-14s link %s %s\n' "$n" "$(ns_name "$n")" "$(node_addr "$n")" "${state#state }" "${qdisc:-unshaped}"
    done
}

cmd_link() {
    check_settings
    [[ $NETNS == 1 && -n $NETNS_SUBNET ]] || die 1 "the test cluster in $DIR was not started in network-namespace mode (HETSEQ_TESTCLUSTER_NETNS=1): it has no links"
    [[ $# == 2 ]] || die 1 "usage: $PROG link NODE down|up|RATE|none (e.g. link n3 down, link n1 1gbit)"
    local n; n=$(node_ref "$1")
    case $2 in
        down|up) ip link set dev "$(veth_root "$n")" "$2" || die 1 "cannot set $n's link $2" ;;
        none) shape "$n" none ;;
        *) rate_ok "$2" || die 1 "'$2' is not down, up, none or a rate like 1gbit, 100mbit"
           shape "$n" "$2" || die 1 "cannot shape $n's link to $2 with tc tbf" ;;
    esac
    log "$n ($(node_addr "$n")): link $2"
}

# ---------------------------------------------------------------------- commands

# A failed start: show why, then stop whatever did start (logs stay for inspection).
start_failed() {
    dump_logs
    cmd_stop >/dev/null 2>&1 || true
    log "start failed; logs kept in $DIR/log"
    exit 1
}

# start_controller (under $LOCK): pick ports and a job-id slot, write the configuration, start
# slurmctld and wait until it answers; a later start then sees its ports and slot in use.
start_controller() {
    pick_ports
    pick_first_job_id
    write_slurm_conf
    write_gres_conf
    write_env_sh
    # -i: ignore errors reading state files (there are none: StateSaveLocation was wiped; the
    # "Could not open ... state file" errors in slurmctld.log are expected).
    slurmctld -i && adopt slurmctld "$RUN/slurmctld.pid" && wait_until "$TIMEOUT" ctld_ping
}

# on_start_exit: the EXIT trap of a start; a start that fails anywhere (a `die`, an error)
# leaves no daemon, namespace, link or /etc/hosts line behind.
START_DONE=0
on_start_exit() {
    local rc=$?
    (( rc == 0 || START_DONE == 1 )) && return 0
    trap - EXIT
    cmd_stop >/dev/null 2>&1 || true
    exit "$rc"
}

cmd_start() {
    check_settings
    local t0; t0=$(now)
    if all_ours_up; then
        [[ $NETNS == "$NETNS_WANTED" ]] ||
            die 1 "the cluster in $DIR is up with HETSEQ_TESTCLUSTER_NETNS=$NETNS: stop it first ($PROG stop) to start it with HETSEQ_TESTCLUSTER_NETNS=$NETNS_WANTED"
        log "cluster already up (state dir $DIR)"
        write_env_sh
        printf 'export SLURM_CONF=%q\n' "$CONF"
        return 0
    fi
    NETNS=$NETNS_WANTED   # check_links reads the mode asked for
    check_links
    (( EUID == 0 )) || die "$EXIT_UNAVAILABLE" "the test cluster needs root (daemons run as SlurmUser=root, mknod, /etc/hosts)"
    ensure_installed
    if any_ours_alive; then
        log "cluster in $DIR is partially running: stopping it first"
        cmd_stop
    fi
    netns_down   # leftovers of a start of this directory that was never stopped
    NETNS=$NETNS_WANTED NETNS_SUBNET=""
    NODES=(n1 n2 n3 n4)
    (( NETNS == 1 )) && use_netns_nodes
    trap on_start_exit EXIT
    prepare_dirs
    make_fake_gpus
    start_munge
    (( NETNS == 0 )) || netns_up
    if ! with_lock start_controller; then
        log "slurmctld did not come up within ${TIMEOUT}s"
        start_failed
    fi
    # One slurmd per emulated node; `-N nK` makes it act as node nK (its port, spool, log).
    local n
    for n in "${NODES[@]}"; do
        if (( NETNS )); then
            # nsenter --net, not `ip netns exec`: that one also remounts /sys in a new mount
            # namespace, without the cgroup mount slurmd needs (and the tests' mounts)
            nsenter --net="/run/netns/$(ns_name "$n")" slurmd -N "$n" || start_failed
        else
            slurmd -N "$n" || start_failed
        fi
    done
    for n in "${NODES[@]}"; do adopt "slurmd-$n" "$RUN/slurmd-$n.pid" || start_failed; done
    if ! wait_until "$TIMEOUT" all_idle; then
        log "nodes not all idle within ${TIMEOUT}s: $(sinfo -h -N -o '%N=%T' | tr '\n' ' ')"
        start_failed
    fi
    # Last: nothing to undo in /etc/hosts if an earlier step failed.
    hosts_add
    log "cluster up in $(elapsed "$t0")s: $(sinfo -h -o '%P(%D nodes, %G)' | tr '\n' ' ')"
    log "logs: $DIR/log   env: . $DIR/env.sh"
    START_DONE=1
    printf 'export SLURM_CONF=%q\n' "$CONF"
}

no_active_jobs() { [[ -z "$(squeue -h -t PD,CF,R,S,CG -o %i 2>/dev/null)" ]]; }

# Cancel every job and wait (bounded) until none is running or completing: stopping slurmd does
# NOT stop running job steps (slurmstepd outlives it).
cancel_all_jobs() {
    ctld_ping || return 0
    local ids
    ids=$(squeue -h -o %i 2>/dev/null | sed 's/+.*//' | sort -u | tr '\n' ' ')
    [[ -n ${ids// } ]] || return 0
    log "cancelling jobs: $ids"
    # shellcheck disable=SC2086  # word splitting of the id list is intended
    scancel $ids 2>/dev/null || true
    wait_until 20 no_active_jobs ||
        log "warning: jobs still not finished after 20s: $(squeue -h -o '%i %T' | tr '\n' ' ')"
}

# stop_pids GRACE PID...: SIGTERM the PIDs, wait up to GRACE s, SIGKILL what is left.
STOPPING=()
stopping_alive() { local p; for p in "${STOPPING[@]}"; do pid_alive "$p" && return 0; done; return 1; }
stopping_dead() { ! stopping_alive; }
stop_pids() {
    local grace=$1 pid left=""; shift
    (( $# )) || return 0
    STOPPING=("$@")
    kill -TERM "$@" 2>/dev/null || true
    wait_until "$grace" stopping_dead && return 0
    for pid in "$@"; do
        if pid_alive "$pid"; then
            log "pid $pid still alive ${grace}s after SIGTERM: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    wait_until 5 stopping_dead && return 0
    for pid in "$@"; do pid_alive "$pid" && left+=" $pid"; done
    log "warning: still alive after SIGKILL:$left"
}

# Leftovers of this cluster's jobs, normally none: after a clean scancel every job is gone
# before the daemons stop. If slurmctld died with jobs running, their slurmstepd processes
# (which outlive slurmd) and the job's processes remain. Both are recognised as ours by
# SLURM_CONF=<our config> in their environment (inherited from our slurmd); job processes
# also have SLURM_JOB_ID. Our own process and its ancestors (a caller that sourced env.sh,
# maybe inside a job) are never selected.
our_ancestors() {
    local p=$$
    while [[ -n $p && $p != 0 ]]; do
        echo "$p"
        p=$(awk '{ sub(/.*\) /, ""); print $2 }' "/proc/$p/stat" 2>/dev/null || true)
    done
}
our_leftovers() {   # our_leftovers stepd|job
    local d pid comm skip
    skip=" $(our_ancestors | tr '\n' ' ') "
    for d in /proc/[0-9]*; do
        pid=${d#/proc/}
        [[ $skip == *" $pid "* ]] && continue
        comm=$(cat "$d/comm" 2>/dev/null) || continue
        { pid_alive "$pid" && pid_has_our_conf "$pid"; } || continue
        if [[ $1 == stepd ]]; then
            [[ $comm == slurmstepd ]] && echo "$pid"
        elif [[ $comm != slurmstepd ]] && tr '\0' '\n' 2>/dev/null < "$d/environ" | grep -q '^SLURM_JOB_ID='; then
            echo "$pid"
        fi
    done
    return 0
}

# other_confs: SLURM_CONF of every other running slurmctld on this host (one per line).
other_confs() {
    local d
    for d in /proc/[0-9]*; do
        [[ "$(cat "$d/comm" 2>/dev/null)" == slurmctld ]] || continue
        pid_alive "${d#/proc/}" && ! pid_has_our_conf "${d#/proc/}" || continue
        tr '\0' '\n' 2>/dev/null < "$d/environ" | sed -n 's/^SLURM_CONF=//p' | head -n1
    done
    return 0
}

# pick_first_job_id: the first job-id slot (JOB_ID_SLOT ids each) that no other running
# cluster's FirstJobId falls in (a cluster without FirstJobId starts at 1: slot 0).
pick_first_job_id() {
    local conf id used=" " slot
    while IFS= read -r conf; do
        [[ -n $conf ]] || continue
        id=$(sed -n 's/^FirstJobId=//p' "$conf" 2>/dev/null | head -n1)
        [[ $id =~ ^[0-9]+$ ]] || id=1
        used+="$(( (id - 1) / JOB_ID_SLOT )) "
    done < <(other_confs)
    for (( slot = 0; slot < JOB_ID_SLOTS; slot++ )); do
        if [[ $used != *" $slot "* ]]; then
            FIRST_JOB_ID=$(( 1 + slot * JOB_ID_SLOT ))
            (( slot == 0 )) || log "job ids start at $FIRST_JOB_ID (other test clusters run here)"
            return 0
        fi
    done
    die 1 "$JOB_ID_SLOTS test clusters already run on this host: stop one first"
}

# other_slurm: the state directory of another running test cluster on this host (its slurmctld's
# SLURM_CONF is <dir>/etc/slurm.conf), else "pid N" of any other Slurm daemon, else nothing.
other_slurm() {
    local d comm conf any=""
    for d in /proc/[0-9]*; do
        comm=$(cat "$d/comm" 2>/dev/null) || continue
        [[ $comm == slurmctld || $comm == slurmd ]] || continue
        pid_alive "${d#/proc/}" || continue
        pid_has_our_conf "${d#/proc/}" && continue
        conf=$(tr '\0' '\n' 2>/dev/null < "$d/environ" | sed -n 's/^SLURM_CONF=//p' | head -n1)
        if [[ $conf == */etc/slurm.conf && -d ${conf%/etc/slurm.conf}/run/ours ]]; then
            echo "${conf%/etc/slurm.conf}"
            return 0
        fi
        any=${any:-"pid ${d#/proc/}"}
    done
    [[ -n $any ]] && echo "$any"
    return 0
}

cmd_stop() {
    check_settings
    local t0 d pid other pids=() leftovers; t0=$(now)
    if ! any_ours_alive; then
        log "no daemon of ours is running (state dir $DIR)"
    else
        cancel_all_jobs
        for d in $(slurm_daemons); do
            ours_alive "$d" && pids+=("$(recorded_pid "$d")")
        done
        (( ${#pids[@]} )) && log "stopping Slurm daemons (pids ${pids[*]})"
        stop_pids 10 "${pids[@]}"
        mapfile -t leftovers < <(our_leftovers job)
        if (( ${#leftovers[@]} )); then
            log "stopping leftover job processes of this cluster: ${leftovers[*]}"
            stop_pids 5 "${leftovers[@]}"
        fi
        mapfile -t leftovers < <(our_leftovers stepd)
        if (( ${#leftovers[@]} )); then
            # slurmstepd ignores SIGTERM: give it a moment to exit on its own, then SIGKILL.
            log "stopping leftover slurmstepd of this cluster: ${leftovers[*]}"
            stop_pids 1 "${leftovers[@]}"
        fi
        if ours_alive munged; then
            pid=$(recorded_pid munged)
            other=$(other_slurm)
            if [[ -n $other ]]; then
                # another cluster authenticates through it: leave it running; a test cluster
                # takes it over (its stop stops it)
                if [[ $other == /* && -d $other/run/ours && ! -e $other/run/ours/munged.pid ]]; then
                    printf '%s\n' "$pid" > "$other/run/ours/munged.pid"
                fi
                log "leaving munged (pid $pid) running: Slurm of $other still uses it"
            else
                log "stopping munged (pid $pid, started by us)"
                stop_pids 10 "$pid"
            fi
        fi
    fi
    rm -f "$OURS"/*.pid 2>/dev/null || true
    hosts_remove
    netns_down
    log "stopped in $(elapsed "$t0")s; logs kept in $DIR/log"
}

cmd_status() {
    check_settings
    local d pid state up=0
    printf 'state dir: %s\nSLURM_CONF=%s\n' "$DIR" "$CONF"
    for d in munged $(slurm_daemons); do
        pid=$(recorded_pid "$d")
        if [[ -z $pid ]]; then
            if [[ $d == munged ]]; then
                if munge_works; then state="running (not started by us)"; else state="not running"; fi
            else
                state="not running"
            fi
        elif ours_alive "$d"; then state="running (pid $pid)"
        else state="dead (was pid $pid)"
        fi
        printf '%-12s %s\n' "$d" "$state"
    done
    (( NETNS == 0 )) || netns_status
    if [[ -f $CONF ]] && all_ours_up; then
        up=1
        printf 'scontrol ping: %s\n' "$(scontrol ping 2>&1 | head -n1)"
        sinfo
    fi
    if (( up )); then echo "cluster: UP"; return 0; fi
    echo "cluster: DOWN"; return 1
}

main() {
    load_netns_record
    case ${1:-} in
        start) cmd_start ;;
        stop) cmd_stop ;;
        status) cmd_status ;;
        link) shift; cmd_link "$@" ;;
        -h|--help|help) usage ;;
        *) usage >&2; exit 1 ;;
    esac
}

main "$@"
