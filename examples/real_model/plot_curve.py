"""The training-reward curve of a run, with the share of replies cut at max_new_tokens.

    python examples/real_model/plot_curve.py docs/artifacts/real_learn/metrics.jsonl docs/figures/real_learn_curve.png

Per update: ``rollout/reward`` (mean over the update's 32 episodes; a moving average of 5
drawn over it) and ``rollout/clipped_frac`` (episodes whose reply reached max_new_tokens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in Path(argv[0]).read_text().splitlines() if x.strip()]
    steps = [int(r["step"]) for r in rows]
    reward = [float(r["rollout/reward"]) for r in rows]
    clipped = [float(r.get("rollout/clipped_frac", float("nan"))) for r in rows]
    avg = [sum(reward[max(0, i - 4): i + 1]) / len(reward[max(0, i - 4): i + 1]) for i in range(len(reward))]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(steps, reward, ".", color="tab:blue", alpha=0.5, label="training reward (per update)")
    ax.plot(steps, avg, "-", color="tab:blue", lw=2, label="training reward (moving average of 5)")
    ax.plot(steps, clipped, "--", color="tab:red", lw=1.5, label="replies cut at max_new_tokens")
    ax.set_xlabel("update")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("SmolLM2-135M-Instruct, LoRA r8, 60 sync GRPO updates of 8 x 4 (examples/real_model/learn.toml)",
                 fontsize=9)
    ax.legend(loc="center right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(argv[1], dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
