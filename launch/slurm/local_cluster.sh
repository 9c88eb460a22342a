#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying launch/slurm/pretrain.sbatch without a real cluster.
# Needs root and Debian's slurmctld, slurmd, slurm-client and munge:
#   apt-get install -y slurmctld slurmd slurm-client munge
# Usage: sudo bash launch/slurm/local_cluster.sh [state dir]   (prints the SLURM_CONF to export)
# MIN_JOB_AGE (s; SLURM's default 300): how long a finished job's record stays (MinJobAge). `sbatch --wait` waits 2 s
# before it first asks after its job, then 4x longer each time while that stays under half of it (and 32 s): at 300
# it asks at 2, 10, 42, 74 s, ... (a 12 s job returned after 42 s), at 10 at 2, 10, 18, 26 s, ... (after 18 s).
set -euo pipefail
state="${1:-/tmp/megafp8-slurm}"
mkdir -p "$state"/{spool,state,log}
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
cat > "$state/slurm.conf" <<CONF
ClusterName=megafp8-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/state
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=${MIN_JOB_AGE:-300}
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
[ -f /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
chmod 400 /etc/munge/munge.key
pgrep -x munged > /dev/null || su -s /bin/sh munge -c /usr/sbin/munged
export SLURM_CONF="$state/slurm.conf"
pgrep -x slurmctld > /dev/null || slurmctld -f "$SLURM_CONF"
pgrep -x slurmd > /dev/null || slurmd -f "$SLURM_CONF"
for _ in $(seq 1 30); do
  sinfo -h -o %t 2>/dev/null | grep -qE "idle|mix|alloc" && break
  sleep 1
done
sinfo
echo "export SLURM_CONF=$SLURM_CONF"
