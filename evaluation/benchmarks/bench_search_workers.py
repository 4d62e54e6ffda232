"""An Optuna search with 1 worker against N local workers on the same cores, on SmolLM2.

Usage: python evaluation/benchmarks/bench_search_workers.py [--trials 4] [--workers 2]
       [--steps 12] [--conversations 40] [--threads-per-worker T] [--out DIR]

Prepares the first bundled ShareGPT conversations once (`hydra-heads prep cache_hidden=true`:
the one-hour recipe trains offline), then runs the real
`hydra-heads sweep sweep=search_cpu` twice, one run after the other on an otherwise idle
machine, with the same seeded random sampler (every trial's values are drawn up front):

  (a) workers=1: the trials one after another, each with all the cores' threads;
  (b) workers=N storage=journal: N worker processes, each with cores / N threads.

and prints each run's wall time, the ratio (a) / (b), each trial's values and τ side by side,
whether the two studies hold the same trials, and the trials' own seconds in each run (the
sum, and that sum split evenly over the workers: what the wall time would be if the last
trials ended together and the workers started at once). τ may differ in the last digits
between the runs: a step with 2 threads sums in another order than with 1.

With --threads-per-worker T, every worker of both runs has T threads (`threads_per_worker=T`):
how the workers scale where each brings cores of its own (a SLURM job per worker), as
`bench_cache_hidden.py --per-process` measures the caching ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = str(Path(sys.executable).parent / "hydra-heads")


def _run(args: list[str]) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)  # the sweep sets each trial's threads itself
    t0 = time.perf_counter()
    r = subprocess.run([CLI, *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"failed: hydra-heads {' '.join(args)}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def _study(out: Path, journal: bool) -> list[tuple[dict, float | None]]:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = (
        JournalStorage(JournalFileBackend(str(out / "study.journal")))
        if journal
        else f"sqlite:///{out / 'study.db'}"
    )
    trials = optuna.load_study(study_name="search_cpu", storage=storage).get_trials()
    return [(t.params, t.value) for t in sorted(trials, key=lambda t: t.number)]


def _trial_seconds(out: Path) -> list[float]:
    """Each trial's own seconds (train + eval), from the sweep's state."""
    return [p["seconds"] for p in json.loads((out / "sweep.json").read_text())["points"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="training steps per trial")
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument(
        "--threads-per-worker", type=int, default=None, help="threads of every worker, both runs"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_search_"))
    data = root / "data"
    if not (data / "prep_stats.json").is_file():
        _run(["prep", f"data.max_conversations={args.conversations}", "data.max_length=256",
              "cache_hidden=true", f"out={data}", "overwrite=true"])  # fmt: skip
    common = [
        "sweep",
        "sweep=search_cpu",
        f"sweep.search.trials={args.trials}",
        "sweep.search.sampler=random",
        "sweep.search.seed=0",
        f'sweep.train=["experiment=smollm2_cpu_1h","trainer.max_steps={args.steps}",'
        '"trainer.val_check_interval=1000","val_tau.prompts=0","final_validation=false",'
        '"logger=csv","data.batch_size=4","data.max_length=256"]',
        'sweep.eval=["eval.suite=mt_bench","eval.num_prompts=2","eval.max_new_tokens=32",'
        '"tree=sparse_15","eval.compare_plain=false"]',
        f'train_args=["data.prepared={data}"]',
        "report=false",
    ]
    if args.threads_per_worker is not None:
        common.append(f"threads_per_worker={args.threads_per_worker}")
    one = _run([*common, f"out={root / 'one'}", "workers=1"])
    many = _run([*common, f"out={root / 'many'}", f"workers={args.workers}", "storage=journal"])
    a, b = _study(root / "one", False), _study(root / "many", True)
    threads = (
        "" if args.threads_per_worker is None else f", {args.threads_per_worker} thread(s) a worker"
    )
    print(f"{args.trials} trials of {args.steps} steps on {os.cpu_count()} cores{threads}")
    print("| run | wall s |\n|---|---|")
    print(f"| workers=1 | {one:.1f} |\n| workers={args.workers} | {many:.1f} |")
    print(f"wall time ratio (1 worker / {args.workers}): {one / many:.2f}x")
    print("\n| trial | values | τ (1 worker) | τ (N workers) |\n|---|---|---|---|")
    for i, ((pa, va), (_, vb)) in enumerate(zip(a, b, strict=False)):
        print(f"| {i} | {json.dumps(pa, sort_keys=True)} | {va} | {vb} |")
    print(f"same trials (values drawn): {[p for p, _ in a] == [p for p, _ in b]}")
    # where the time goes: trials run slower beside each other, and the last ones rarely end
    # together (the workers' start-up is in the wall time too)
    sa, sb = _trial_seconds(root / "one"), _trial_seconds(root / "many")
    print(
        f"trial seconds in all: {sum(sa):.1f} with 1 worker, {sum(sb):.1f} with "
        f"{args.workers} ({sum(sb) / sum(sa):.2f}x: trials beside each other run slower); "
        f"split evenly over the workers that is {sum(sb) / args.workers:.1f} s a worker"
    )


if __name__ == "__main__":
    main()
