# syntax=docker/dockerfile:1.7
# One image for both Slurm roles; the compose command picks one: `controller` (munged, slurmdbd, slurmctld) or
# `gpu-node` (munged, slurmd, and sshd on the login node). Build context is the repository root (docker-compose.yaml).
FROM debian:bookworm-slim

# The job user shares Airflow's UID and group 0 so both can write checkpoints on the shared volume.
ARG JOB_UID=50000

# Host keys are removed: sshd's key comes from a docker secret, so known_hosts can pin it across rebuilds.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        munge slurmctld slurmd slurmdbd slurm-client openssh-server python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_* \
 && useradd --uid "${JOB_UID}" --gid 0 --create-home --shell /bin/bash mlops \
 && usermod -p '*' mlops

# UsePAM no: sshd then needs an unlocked account (the '*' password above) but no PAM stack.
COPY <<'CONF' /etc/ssh/sshd_config.d/hybridflow.conf
Port 2222
HostKey /etc/ssh/ssh_host_ed25519_key
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
UsePAM no
AllowUsers mlops
CONF

COPY --chmod=0755 <<'SCRIPT' /usr/local/bin/slurm-entrypoint
#!/bin/bash
# Renders the Slurm configuration from the environment, so the controller and the nodes always agree on it,
# installs the secrets from /run/secrets, then starts the role's daemons.
#   SLURM_NODES       every GPU node as NAME:ADDRESS (the compose service), space-separated; same for all roles
#   SLURM_NODE_NAME   gpu-node role: which of them this container is
#   SLURM_LOGIN_NODE  gpu-node role: "true" runs sshd (Airflow's SSH login node) next to slurmd
# `slurm-entrypoint render-conf` prints slurm.conf and gres.conf and exits (tests/unit/test_compose_file.py).
set -euo pipefail

: "${SLURM_CLUSTER_NAME:=hybridflow}" "${SLURM_NODE_CPUS:=8}" "${SLURM_NODE_MEMORY_MB:=20000}"
: "${SLURM_GPU_TYPE:=h200}" "${SLURM_GPU_COUNT:=8}" "${SLURM_NODES:=gpu-node-01:slurm-gpu-node}"
: "${SLURM_LOGIN_NODE:=false}"
NODE_LINES="" GRES_LINES="" NODE_NAMES=""
for entry in ${SLURM_NODES}; do
  name=${entry%%:*} addr=${entry#*:}
  [[ -n "${name}" && -n "${addr}" && "${entry}" == *:* ]] || { echo "bad SLURM_NODES entry '${entry}'" >&2; exit 2; }
  NODE_LINES+="NodeName=${name} NodeAddr=${addr} CPUs=${SLURM_NODE_CPUS} RealMemory=${SLURM_NODE_MEMORY_MB} Gres=gpu:${SLURM_GPU_TYPE}:${SLURM_GPU_COUNT} State=UNKNOWN"$'\n'
  GRES_LINES+="NodeName=${name} Name=gpu Type=${SLURM_GPU_TYPE} File=/dev/nvidia[0-$((SLURM_GPU_COUNT - 1))]"$'\n'
  NODE_NAMES+="${NODE_NAMES:+,}${name}"
done

wait_for_port() {
  for _ in $(seq 60); do (: </dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 1; done
  echo "nothing listens on port $1 after 60 s" >&2; return 1
}

# Containers get no cgroup delegation without privileges: linuxproc tracking and no task plugin.
# config_overrides lets the node advertise the declared CPUs whatever the container sees.
render_slurm_conf() {
  cat <<CONF
ClusterName=${SLURM_CLUSTER_NAME}
SlurmctldHost=slurm-controller
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=slurm-controller
AccountingStorageTRES=gres/gpu
${NODE_LINES}PartitionName=cpu Nodes=${NODE_NAMES} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu-training Nodes=${NODE_NAMES} MaxTime=INFINITE State=UP
CONF
}

if [[ "${1:-}" == render-conf ]]; then
  render_slurm_conf
  printf '%s' "${GRES_LINES}"
  exit 0
fi
render_slurm_conf > /etc/slurm/slurm.conf

install -o munge -g munge -m 0400 /run/secrets/munge_key /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o slurm -g slurm /run/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd
runuser -u munge -- /usr/sbin/munged

case "${1:-}" in
  controller)
    # slurmdbd refuses a config that is readable by others or not owned by SlurmUser.
    install -o slurm -g slurm -m 0600 /dev/null /etc/slurm/slurmdbd.conf
    cat > /etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=slurm-controller
SlurmUser=slurm
PidFile=/run/slurm/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=slurm-db
StoragePort=3306
StorageUser=slurm
StoragePass=${SLURMDBD_DB_PASSWORD:?SLURMDBD_DB_PASSWORD is required}
StorageLoc=slurm_acct_db
CONF
    slurmdbd -D &
    wait_for_port 6819
    exec slurmctld -D
    ;;
  gpu-node)
    NODE=${SLURM_NODE_NAME:?SLURM_NODE_NAME is required for the gpu-node role}
    [[ ",${NODE_NAMES}," == *",${NODE},"* ]] || { echo "SLURM_NODE_NAME=${NODE} is not in SLURM_NODES" >&2; exit 2; }
    # A missing device file hangs slurmd at start; fail loudly instead.
    for ((i = 0; i < SLURM_GPU_COUNT; i++)); do
      [[ -c /dev/nvidia${i} ]] || { echo "SLURM_GPU_COUNT=${SLURM_GPU_COUNT} but /dev/nvidia${i} is missing" >&2; exit 1; }
    done
    printf '%s' "${GRES_LINES}" > /etc/slurm/gres.conf
    if [[ "${SLURM_LOGIN_NODE}" == true ]]; then
      install -o root -g root -m 0600 /run/secrets/slurm_ssh_host_key /etc/ssh/ssh_host_ed25519_key
      install -d -o mlops -g root -m 0700 /home/mlops/.ssh
      install -o mlops -g root -m 0600 /run/secrets/slurm_ssh_authorized_keys /home/mlops/.ssh/authorized_keys
      install -d -m 0755 /run/sshd
      /usr/sbin/sshd -D -e &
      wait_for_port 2222
    fi
    exec slurmd -D -N "${NODE}"
    ;;
  *)
    echo "usage: slurm-entrypoint controller|gpu-node|render-conf" >&2
    exit 2
    ;;
esac
SCRIPT

ENTRYPOINT ["/usr/local/bin/slurm-entrypoint"]
