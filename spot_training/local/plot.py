"""``training.png``: the drill's training curve with the interruptions marked (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_training(log_path: Path, report: dict[str, Any], out_path: Path) -> Path:
    """Plot loss and accuracy per step from ``training_log.csv``, a vertical line per interruption.

    Args:
        log_path: the trainer's ``training_log.csv`` (rows over all runs; a step logged twice would
            show as a backward jump).
        report: the drill report (``interruption_events`` with ``checkpoint_step``, ``from_az``,
            ``to_az``, ``volume_moved``, ``boot_to_resume_s``).
        out_path: the PNG to write (its directory must exist).

    Returns:
        ``out_path``.

    Raises:
        FileNotFoundError: ``log_path`` does not exist (nothing was trained).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from spot_training.local.injector import read_training_log

    if not Path(log_path).exists():
        raise FileNotFoundError(f"no training log at {log_path}; the drill trained nothing to plot")
    rows = read_training_log(Path(log_path))
    steps = [r["step"] for r in rows]
    figure, loss_axis = plt.subplots(figsize=(10, 5), dpi=110)
    loss_axis.plot(steps, [r["loss"] for r in rows], color="tab:blue", linewidth=1.2, label="loss (epoch so far)")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("training loss", color="tab:blue")
    accuracy_axis = loss_axis.twinx()
    accuracy_axis.plot(steps, [r["accuracy"] for r in rows], color="tab:green", linewidth=1.0, alpha=0.8,
                       label="accuracy (epoch so far)")
    accuracy_axis.set_ylabel("training accuracy", color="tab:green")
    accuracy_axis.set_ylim(0, 1.02)
    for event in report.get("interruption_events", []):
        step = event["checkpoint_step"]
        moved = event.get("volume_moved")
        color = "tab:red" if moved else "tab:orange"
        loss_axis.axvline(step, color=color, linestyle="--", linewidth=1.2)
        label = f"#{event['index']} spot interruption\n{event['from_az']} -> {event['to_az']}"
        label += "\n(volume moved)" if moved else ""
        label += f"\nresumed in {event['boot_to_resume_s']:.0f} s"
        # On the top axis (drawn last) in the empty middle band, so no curve hides the label.
        accuracy_axis.annotate(label, xy=(step, 0.62), xycoords=("data", "axes fraction"), xytext=(4, 0),
                           textcoords="offset points", va="top", fontsize=8, color=color,
                           bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.85, "edgecolor": color})
    title = (f"{report.get('stack', 'SpotTraining')} local drill: {report.get('steps_total', 0)} steps, "
             f"{report.get('interruptions', 0)} interruptions, {report.get('az_moves', 0)} AZ move(s), "
             f"lost steps {report.get('lost_steps')}, test accuracy {report.get('test_accuracy')}")
    if report.get("savings_pct") is not None:  # read back from the local AWS (spot-train cost)
        title += f"\nspot savings {report['savings_pct']:.3f} % vs on-demand (local AWS spot prices, stated on-demand price)"
    loss_axis.set_title(title, fontsize=10)
    handles = loss_axis.get_legend_handles_labels()[0] + accuracy_axis.get_legend_handles_labels()[0]
    loss_axis.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(out_path)
    plt.close(figure)
    return Path(out_path)
