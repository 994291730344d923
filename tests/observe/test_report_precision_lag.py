"""`mixrl report` shows precision vs lag KL per sampler group over the updates, from the recorded metrics."""

import base64
import json
import math
import random
import re
from argparse import Namespace

from mixrl.lab.study import report
from mixrl.lab.study.plots import precision_lag_figure, precision_lag_means
from mixrl.lab.study.runs import load_run

GROUPS = ("b200-nvfp4", "h100-fp8", "b200-bf16")


def _write(d, per_group=True, splits=("precision", "lag")):
    """An async run's metrics: a split is absent on steps where it had no tokens."""
    rng = random.Random(7)
    d.mkdir(parents=True)
    rows, recorded = [], {}
    for step in range(1, 31):
        row = {"step": step, "time": float(step), "rollout/reward": 0.3}
        for gi, g in enumerate(GROUPS if per_group else ("",)):
            suffix = f"/{g}" if g else ""
            if per_group:
                row[f"share/samples/{g}"] = 1 / 3
            for split in splits:
                if split == "precision" and step % 3 and step > 2:  # staleness-0 tokens only now and then
                    continue
                tokens = rng.randint(5, 200)
                kl = 10 ** rng.uniform(-6, -2) * (gi + 1) * (10 if split == "lag" else 1)
                row[f"{split}/tokens{suffix}"] = tokens
                row[f"{split}/kl_exact{suffix}"] = kl
                row[f"{split}/kl_k3{suffix}"] = kl * 2  # the estimator not shown when exact exists
                recorded.setdefault((g or "all groups", split), []).append((step, kl, tokens))
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return recorded


def test_report_embeds_the_precision_lag_figure_and_table(tmp_path):
    d = tmp_path / "async_run"
    recorded = _write(d)
    assert report.main(Namespace(dir=d, k=None, png=False)) == 0
    png = d / "figures" / "precision_lag.png"
    assert png.exists() and png.stat().st_size > 10_000
    html, md = (d / "report.html").read_text(), (d / "report.md").read_text()
    m = re.search(r'<img alt="precision_lag" src="data:image/png;base64,([^"]+)"', html)
    assert m and base64.b64decode(m.group(1)) == png.read_bytes()  # the figure travels inside the HTML
    assert "![precision_lag](figures/precision_lag.png)" in md
    assert "## Precision vs lag KL per sampler group (`async_run`)" in md
    table = md.split("## Precision vs lag KL per sampler group")[1].split("## Figures")[0]
    assert "| group | precision kl_exact | precision tokens | lag kl_exact | lag tokens |" in table
    for g in GROUPS:
        tokens = sum(t for _, _, t in recorded[(g, "precision")])
        assert re.search(rf"\| {re.escape(g)} \| [^|]+ \| {tokens} \|", table), g


def test_plotted_series_are_the_recorded_metrics(tmp_path):
    d = tmp_path / "r"
    recorded = _write(d)
    fig = precision_lag_figure(load_run(d))
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(panels) == set(GROUPS)
    for g, ax in panels.items():
        lines = {ln.get_label().split(":")[0]: ln for ln in ax.lines}
        assert set(lines) == {"precision", "lag"}
        for split, ln in lines.items():
            want = recorded[(g, split)]
            assert list(ln.get_xdata()) == [s for s, _, _ in want]
            assert list(ln.get_ydata()) == [kl for _, kl, _ in want]  # the exact KL, not k3
    assert any(0 < len(recorded[(g, "precision")]) < 30 for g in GROUPS)  # steps without tokens are skipped


def test_means_are_token_weighted_as_computed_by_hand(tmp_path):
    d = tmp_path / "r"
    recorded = _write(d)
    rows = {r["group"]: r for r in precision_lag_means(load_run(d))}
    for g in GROUPS:
        for split in ("precision", "lag"):
            pts = recorded[(g, split)]
            want = math.fsum(kl * t for _, kl, t in pts) / math.fsum(t for _, _, t in pts)
            assert math.isclose(rows[g][f"{split} kl_exact"], want, rel_tol=1e-12)
            assert rows[g][f"{split} tokens"] == sum(t for _, _, t in pts)


def test_whole_batch_metrics_without_groups(tmp_path):
    d = tmp_path / "r"
    recorded = _write(d, per_group=False)
    fig = precision_lag_figure(load_run(d))
    ax = next(a for a in fig.axes if a.get_title() == "all groups")
    assert [ln.get_ydata().tolist() for ln in ax.lines] == [
        [kl for _, kl, _ in recorded[("all groups", s)]] for s in ("precision", "lag")]


def test_no_split_metrics_no_figure(tmp_path):
    d = tmp_path / "old_run"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward": 0.1, "mismatch/kl_k3": 1e-3}) + "\n")
    assert report.main(Namespace(dir=d, k=None, png=False)) == 0
    assert not (d / "figures" / "precision_lag.png").exists()
    assert "Precision vs lag" not in (d / "report.md").read_text()


def test_the_group_bars_show_the_tables_numbers(tmp_path, monkeypatch):
    """The per-group KL bars and the precision-vs-lag table are one number per group: token-weighted,
    same estimator (recomputed here from what was recorded, in float64)."""
    from mixrl.lab.study import plots

    d = tmp_path / "async_run"
    recorded = _write(d)
    run = load_run(d)
    drawn = {}
    real_subplots = None

    def spy(*a, **kw):
        fig, axes = real_subplots(*a, **kw)
        drawn["ax"] = axes[0]
        return fig, axes

    plt = plots._plt()
    real_subplots = plt.subplots
    monkeypatch.setattr(plt, "subplots", spy)
    assert plots.plot_groups(run, tmp_path) is not None
    heights = {t.get_text(): b.get_height() for t, b in zip(drawn["ax"].get_xticklabels(), drawn["ax"].patches,
                                                              strict=True)}
    table = {r["group"]: r["precision kl_exact"] for r in precision_lag_means(run)}
    for g in GROUPS:
        xs = recorded[(g, "precision")]
        want = math.fsum(kl * t for _, kl, t in xs) / math.fsum(t for _, _, t in xs)
        assert math.isclose(table[g], want, rel_tol=1e-12)
        assert math.isclose(heights[g], want, rel_tol=1e-12), (g, heights[g], want)
    unweighted = {g: sum(kl for _, kl, _ in recorded[(g, "precision")]) / len(recorded[(g, "precision")]) for g in GROUPS}
    assert any(not math.isclose(unweighted[g], table[g], rel_tol=1e-3) for g in GROUPS)  # weighting matters here
