"""`hydra-heads prep`: validate the config, run data preparation, print the stats."""

from __future__ import annotations

from typing import Any

CONFIG_NAME = "prep"
# A working command line, shown when a required key is missing.
EXAMPLE = "hydra-heads prep data.max_conversations=2000 out=runs/demo/data"


def print_stats(stats: dict[str, Any], out: str) -> None:
    """Readable summary of prep_stats.json."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"prep: {out}", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    inputs = stats["input"] if isinstance(stats["input"], list) else [stats["input"]]
    t.add_row("input", "\n".join(map(str, inputs)))
    for src in stats.get("merged_from") or []:  # from_prepared=[A, B, ...]
        n = " + ".join(f"{v:,} {k}" for k, v in src["samples"].items())
        t.add_row(f"  from {src['path']}", f"{n}, {src['duplicates_dropped']:,} repeats dropped")
    t.add_row("records read", f"{stats['records_read']:,}")
    t.add_row("conversations kept", f"{stats['conversations_kept']:,}")
    t.add_row("skipped (total)", f"{stats['skipped_total']:,}")
    for reason, n in stats["skipped"].items():
        t.add_row(f"  skipped: {reason}", f"{n:,}")
    t.add_row("leading assistant turns dropped", f"{stats['leading_assistant_turns_dropped']:,}")
    t.add_row(
        f"conversations > {stats['max_length']} tokens",
        f"{stats['conversations_over_max_length']:,} ({stats['long_conversations']})",
    )
    pct = stats["conversation_token_percentiles"]
    if pct:
        t.add_row(
            "conversation tokens p50 / p90 / max",
            f"{pct['p50']:,.0f} / {pct['p90']:,.0f} / {pct['max']:,}",
        )
    regen = stats.get("regeneration")
    if regen:
        t.add_row(
            "regenerated turns (reply tokens)", f"{regen['turns']:,} ({regen['reply_tokens']:,})"
        )
        rate = f"{regen['tokens_per_s']:,.1f} tokens/s generating"
        if regen.get("prompt_tokens"):  # prep_stats.json from before it was recorded: none
            rate += f" after {regen['prompt_tokens']:,} prompt tokens"
        if "turns_per_hour" in regen:
            rate += f", {regen['turns_per_hour']:,} turns an hour"
        t.add_row("regeneration", f"{regen['wall_s'] / 60:,.1f} min: {rate}")
        spread = regen.get("shard_turns_per_min")
        if spread:
            t.add_row(
                f"turns a minute per shard ({len(regen['shards_run'])} run)",
                f"min {spread['min']:,} / median {spread['median']:,} / max {spread['max']:,}",
            )
    for split, s in stats["splits"].items():
        t.add_row(f"{split}: samples", f"{s['samples']:,}")
        t.add_row(f"{split}: tokens (trainable)", f"{s['tokens']:,} ({s['trainable_tokens']:,})")
    timing = stats.get("timing", {})
    if "total_s" in timing:
        t.add_row("time", f"{timing['total_s']:.1f} s")
    console.print(t)
    if stats.get("sources"):  # data=mixture
        m = Table(title="mixture: per source")
        for col in ("source", "weight", "read", "usable", "target", "selected", "kept", "skipped"):
            m.add_column(col, justify="left" if col == "source" else "right")
        for name, src in stats["sources"].items():
            m.add_row(
                name,
                f"{src['weight']:g}",
                *(f"{src[k]:,}" for k in ("records_read", "usable", "target", "selected", "kept")),
                f"{src['skipped_total']:,}",
            )
        console.print(m)
    for w in stats["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")


def run(cfg) -> dict[str, Any]:
    from data_prep.config import PrepConfig
    from data_prep.prepare import prepare
    from train.core.config import load, resolved_yaml

    typed = load(cfg, PrepConfig, EXAMPLE)  # fails here, before any heavy work, on a bad config
    stats = prepare(typed, resolved_config=resolved_yaml(cfg))
    if "rank" in stats:  # a launcher's rank > 0: its share of cache_hidden, no output of its own
        print(f"rank {stats['rank']}/{stats['world']}: its hidden-state chunks are cached")
        return stats
    print_stats(stats, typed.out)
    return stats


if __name__ == "__main__":  # how multi-process launchers re-run this subcommand on other ranks
    import sys

    from launch.cli import main

    main(["prep", *sys.argv[1:]])
