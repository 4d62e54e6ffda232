#!/usr/bin/env bash
# Stop the one-node SLURM cluster started by local_cluster_up.sh (slurmd, slurmctld, munged). Idempotent.
set -uo pipefail
log() { echo "[local_cluster_down $(date +%T)] $*" >&2; }
pid_of() { local p; p="$(cat "$1" 2>/dev/null)" && [[ -n "$p" ]] && [[ "$(cat /proc/"$p"/comm 2>/dev/null)" == "$2" ]] \
           && ! grep -q '^State:[[:space:]]*Z' /proc/"$p"/status 2>/dev/null && echo "$p"; }

# Cancel what is still queued/running so slurmd does not leave orphaned job steps behind.
if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q 'is UP'; then
  if [[ -n "$(squeue -h 2>/dev/null)" ]]; then
    log "cancelling jobs"; squeue -h -o %A | xargs -r scancel || true
    for _ in $(seq 50); do [[ -z "$(squeue -h 2>/dev/null)" ]] && break; sleep 0.2; done
  fi
fi
# `scontrol shutdown` = orderly stop of slurmctld and every slurmd (saves state first).
scontrol shutdown >/dev/null 2>&1 || true

stop() {  # stop PIDFILE NAME: SIGTERM, wait up to 10 s, then SIGKILL
  local p; p="$(pid_of "$1" "$2")" || { log "$2 not running"; rm -f "$1"; return 0; }
  kill -TERM "$p" 2>/dev/null
  for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || { log "$2 ($p) stopped"; rm -f "$1"; return 0; }; sleep 0.1; done
  log "$2 ($p) did not stop, SIGKILL"; kill -KILL "$p" 2>/dev/null; rm -f "$1"
}
stop /run/slurmd.pid slurmd
stop /run/slurmctld.pid slurmctld
stop /run/munge/munged.pid munged
exit 0
