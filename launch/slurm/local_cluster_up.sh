#!/usr/bin/env bash
# Install, configure and start a one-node SLURM cluster on localhost, without systemd.
# Run as root. Idempotent: re-running leaves running daemons alone (or starts missing ones)
# and only rewrites slurm.conf when its content changed (then does `scontrol reconfigure`).
set -euo pipefail

NODE="$(hostname -s)"
NCPU="${SLURM_CPUS:-$(nproc)}"
CONF=/etc/slurm/slurm.conf

log() { echo "[local_cluster_up $(date +%T)] $*" >&2; }
# alive PIDFILE NAME: the pid in PIDFILE is running and is NAME (guards against stale pidfiles/reused pids)
# Zombies count as dead: PID 1 here (process_api) does not reap orphans promptly, so a killed daemon can
# linger as <defunct> with the right /proc/PID/comm.
alive() { local p; p="$(cat "$1" 2>/dev/null)" && [[ -n "$p" ]] && [[ "$(cat /proc/"$p"/comm 2>/dev/null)" == "$2" ]] \
          && ! grep -q '^State:[[:space:]]*Z' /proc/"$p"/status 2>/dev/null; }

# --- 1. packages (Debian 12 bookworm: slurm 22.05.8, munge 0.5.15; same names on Debian 13) --------
PKGS=(munge slurmctld slurmd slurm-client)
if [[ $(dpkg-query -W -f='${Status}\n' "${PKGS[@]}" 2>/dev/null | grep -c '^install ok installed$') -eq ${#PKGS[@]} ]]; then
  log "packages already installed"
else
  log "installing ${PKGS[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -q
  # policy-rc.d: keep postinst from trying to start services (no init system in this VM).
  # Only add one if the image has none, and remove only what we added.
  added_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; added_policy=1
  fi
  apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${PKGS[@]}"
  [[ $added_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d
fi

# The node name must resolve: SLURM_NODELIST (-> Lightning's MASTER_ADDR) is this name.
getent hosts "$NODE" >/dev/null || { log "adding $NODE to /etc/hosts"; echo "127.0.0.1 $NODE" >> /etc/hosts; }

# --- 2. munge ---------------------------------------------------------------------------------------
# The munge postinst normally creates /etc/munge/munge.key; create it if it is missing.
if [[ ! -s /etc/munge/munge.key ]]; then
  log "creating munge key"
  mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge /etc/munge/munge.key
chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge       # systemd's RuntimeDirectory= normally does this
install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge

if alive /run/munge/munged.pid munged; then
  log "munged already running (pid $(cat /run/munge/munged.pid))"
else
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged            # forks into the background, writes /run/munge/munged.pid
fi
# munged's parent exits only once the socket is ready. (A munge client against a dead socket retries for
# seconds, so keep this loop short.)
ok=0; for _ in $(seq 5); do timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1 && { ok=1; break; }; sleep 0.5; done
[[ $ok == 1 ]] || { log "munge does not work"; tail -20 /var/log/munge/munged.log >&2; exit 1; }

# --- 3. slurm.conf ----------------------------------------------------------------------------------
install -d -o slurm -g slurm -m 0755 /var/spool/slurmctld /var/log/slurm
install -d -o root  -g root  -m 0755 /var/spool/slurmd
new_conf="$(mktemp)"
cat > "$new_conf" <<EOF
# One-node SLURM cluster on localhost (written by local_cluster_up.sh)
ClusterName=localcluster
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
SlurmctldPort=6817
SlurmdPort=6818

SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info

# no cgroups, no accounting: works in a container/microVM without systemd
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none

SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# a node that was DOWN (e.g. daemons killed) becomes usable again as soon as slurmd registers
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0

NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${NCPU} State=UNKNOWN
PartitionName=debug Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
conf_changed=0
if ! cmp -s "$new_conf" "$CONF"; then
  log "writing $CONF"
  install -m 0644 "$new_conf" "$CONF"; conf_changed=1
fi
rm -f "$new_conf"

# --- 4. daemons -------------------------------------------------------------------------------------
if alive /run/slurmctld.pid slurmctld; then
  log "slurmctld already running (pid $(cat /run/slurmctld.pid))"
else
  log "starting slurmctld"
  /usr/sbin/slurmctld                              # daemonizes; drops to SlurmUser=slurm
  conf_changed=0
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.2; done
scontrol ping | grep -q 'is UP' || { log "slurmctld did not come up"; tail -20 /var/log/slurm/slurmctld.log >&2; exit 1; }

if alive /run/slurmd.pid slurmd; then
  log "slurmd already running (pid $(cat /run/slurmd.pid))"
else
  log "starting slurmd"
  /usr/sbin/slurmd                                 # daemonizes; runs as root
fi
if [[ $conf_changed == 1 ]]; then log "config changed: scontrol reconfigure"; scontrol reconfigure; fi

# --- 5. wait for the node to be idle -----------------------------------------------------------------
state=""
for i in $(seq 120); do
  state="$(sinfo -h -n "$NODE" -o %t 2>/dev/null | head -1)"
  case "$state" in
    idle|mix|alloc) break ;;
    down*|drain*|drng*)                            # left over from an earlier run's saved state
      (( i % 10 == 1 )) && scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 0.5
done
case "$state" in
  idle|mix|alloc) log "node $NODE is $state"; sinfo ;;
  *) log "node $NODE not ready (state '$state')"; scontrol show node "$NODE" >&2
     tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2; exit 1 ;;
esac
