"""The A/B table (rich when installed, plain text otherwise) and the plot.

Columns (one row per configuration; docs/benchmarks.md explains each):

    config, layout, dev (attention+FFN), b (per rank), T ms (median), p90, tok/s/dev (all
    devices), tok/s/att (attention devices), S_all, S_att, batch x overlap x r/(r+1), same
    (greedy tokens identical to single-rank colocated), pred ms, err % and err@V % (the error
    with the prediction scaled to the colocated baseline's measured speed) with --profile, status.

With --speculative-config: tok/step (tokens per request and step over the window), acc %
(accepted / draft tokens), acc len (mean acceptance length, 1 + accepted / drafts), and the
split gains the token gain: batch x tok x overlap x r/(r+1).
"""

from __future__ import annotations

import json
from typing import Any

COLUMNS = (
    ("config", "name", "{}"),
    ("layout", "layout", "{}"),
    ("dev", "_devices", "{}"),
    ("b", "per_rank_batch", "{}"),
    ("T ms", "step_ms", "{:.2f}"),
    ("p90", "step_p90_ms", "{:.2f}"),
    ("tok/step", "tokens_per_step", "{:.2f}"),
    ("acc %", "_acceptance_pct", "{:.1f}"),
    ("acc len", "mean_acceptance_length", "{:.2f}"),
    ("tok/s/dev", "tok_s_per_device", "{:.0f}"),
    ("tok/s/att", "tok_s_per_attention_device", "{:.0f}"),
    ("S_all", "s_all", "{:.3f}"),
    ("S_att", "s_att", "{:.3f}"),
    ("batch x overlap x r/(r+1)", "_split", "{}"),
    ("same", "_same", "{}"),
    ("pred ms", "predicted_ms", "{:.2f}"),
    ("err %", "error_pct", "{:+.1f}"),
    ("err@V %", "error_scaled_pct", "{:+.1f}"),
    ("status", "_status", "{}"),
)


def _derived(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    out["_devices"] = f"{row['attention_ranks']}+{row['ffn_ranks']}"
    if row.get("batch_gain") is not None and row.get("overlap_gain") is not None:
        cost = row.get("disaggregation_cost")
        cost_text = f"{cost:.3f}" if cost is not None else "1"
        token = f"{row['token_gain']:.3f} x " if row.get("token_gain") is not None else ""
        out["_split"] = f"{row['batch_gain']:.2f} x {token}{row['overlap_gain']:.3f} x {cost_text}"
    if row.get("acceptance_rate") is not None:
        out["_acceptance_pct"] = 100 * row["acceptance_rate"]
    same = row.get("identical")
    out["_same"] = "-" if same is None else ("yes" if same else "NO")
    status = row["status"]
    out["_status"] = ("baseline" if row.get("baseline") else "ok") if status == "ok" else status
    return out


def cells(row: dict[str, Any]) -> list[str]:
    """The table cells of one row ('-' where a value does not apply)."""
    d = _derived(row)
    out = []
    for _, key, fmt in COLUMNS:
        value = d.get(key)
        out.append("-" if value is None else fmt.format(value))
    return out


def has_predictions(rows: list[dict[str, Any]]) -> bool:
    return any("predicted_ms" in r for r in rows)


SPEC_COLUMNS = {"tok/step", "acc %", "acc len"}
SPLIT = "batch x overlap x r/(r+1)"


def has_speculation(rows: list[dict[str, Any]]) -> bool:
    return any("spec_decode" in r or "token_gain" in r for r in rows)


def _columns(rows: list[dict[str, Any]]) -> list[int]:
    drop = set() if has_predictions(rows) else {"pred ms", "err %", "err@V %"}
    if not has_speculation(rows):
        drop |= SPEC_COLUMNS
    return [i for i, (title, _, _) in enumerate(COLUMNS) if title not in drop]


def _title(i: int, rows: list[dict[str, Any]]) -> str:
    title = COLUMNS[i][0]
    if title == SPLIT and any(r.get("token_gain") is not None for r in rows):
        return "batch x tok x overlap x r/(r+1)"
    return title


def footnotes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row whose prediction comes with a note (``ab.add_predictions``)."""
    return [f"{r['name']}: {r['prediction_note']}" for r in rows if r.get("prediction_note")]


def format_plain(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table and its footnotes."""
    keep = _columns(rows)
    table = [[_title(i, rows) for i in keep]] + [[cells(r)[i] for i in keep] for r in rows]
    widths = [max(len(line[j]) for line in table) for j in range(len(keep))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join([line.rstrip() for line in lines] + footnotes(rows))


def header(settings: dict[str, Any]) -> str:
    text = (
        f"vllm-afd bench: {settings['model']}  prompt {settings['prompt_len']} + "
        f"output {settings['output_len']} tokens, {settings['threads']} thread(s) per rank, "
        f"{settings['rounds']} interleaved decode(s) per config, {settings['dtype']}"
    )
    spec = settings.get("speculative_config")
    if spec:
        text += f", speculative {json.dumps(spec, separators=(',', ':'))} in every config"
    return text


def print_table(rows: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    """Print the table (rich if available) with its header and footnotes."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(header(settings))
        print(format_plain(rows))
        return
    table = Table(title=header(settings), title_justify="left")
    keep = _columns(rows)
    for i in keep:
        left = COLUMNS[i][0] in ("config", "layout", "status")
        table.add_column(_title(i, rows), justify="left" if left else "right")
    for row in rows:
        c = cells(row)
        table.add_row(*[c[i] for i in keep])
    console = Console(width=220)
    console.print(table)
    for line in footnotes(rows):
        console.print(line, highlight=False)


def write_plot(rows: list[dict[str, Any]], path: str) -> None:
    """Tokens/s per device (all devices, attention only), S_all and, with a profile, the
    measured against the predicted step period, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "tok_s_per_device" in r]
    x = list(range(len(ok)))
    panels = 3 if has_predictions(ok) else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    ax1, ax2 = axes[0], axes[1]
    ax1.bar([i - 0.2 for i in x], [r["tok_s_per_device"] for r in ok], 0.4, label="all devices")
    ax1.bar(
        [i + 0.2 for i in x],
        [r["tok_s_per_attention_device"] for r in ok],
        0.4,
        label="attention devices",
    )
    ax1.set_ylabel("decode tokens/s per device")
    ax1.legend()
    ax2.bar(x, [r.get("s_all") or 0 for r in ok], 0.6, color="tab:green")
    ax2.axhline(1.0, color="grey", linewidth=1)
    ax2.set_ylabel("S_all vs best colocated")
    if panels == 3:
        axes[2].bar([i - 0.2 for i in x], [r["step_ms"] for r in ok], 0.4, label="measured")
        axes[2].bar(
            [i + 0.2 for i in x],
            [r.get("predicted_ms") or 0 for r in ok],
            0.4,
            label="planner (CPU profile)",
        )
        axes[2].set_ylabel("decode step period, ms")
        axes[2].legend()
    for ax in axes:
        ax.set_xticks(x, [r["name"] for r in ok], rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
