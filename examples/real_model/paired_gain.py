"""The held-out gain of the real-model example, paired by row.

The base and the trained model are evaluated on the same 150 held-out rows with the same
sampling seed (``mixrl eval ... --k 1 --json``; ``per_task`` holds, per row, the samples and
the successes). Two unpaired Wilson intervals ignore that pairing: rows that are easy (or
hard) for both models add variance to each arm that their difference does not have. Here
the unit is the row: ``d_i = final_i - base_i`` in {-1, 0, +1}, and the gain is mean(d) with

- a paired t-interval over rows (``mixrl.lab.study.paired.paired_t``);
- a paired percentile bootstrap over rows (rows resampled with replacement, one draw for
  both models);
- McNemar's exact test (k = 1 only: each row solved or not): under no effect each discordant row (solved by one model only) is
  equally likely to favour either, so the count that favours the trained model is
  Binomial(discordant, 1/2); two-sided p-value.

    python examples/real_model/paired_gain.py docs/artifacts/eval_real_base.json \\
        docs/artifacts/eval_real_final.json > docs/artifacts/real_model_paired.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from mixrl.lab.study.paired import paired_t


def per_row(artifact: dict[str, Any]) -> dict[str, float]:
    """Row id -> success rate of its samples (k = 1, n = 1: 0 or 1)."""
    res = artifact.get("result", artifact)
    return {row: s / n for row, (n, s) in res["per_task"].items()}


def paired_gain(base: dict[str, float], final: dict[str, float], level: float = 0.95,
                draws: int = 20000, seed: int = 0) -> dict[str, Any]:
    if sorted(base) != sorted(final):
        raise ValueError("the two evaluations must cover the same held-out rows")
    rows = sorted(base, key=lambda r: (len(r), r))
    b = np.array([base[r] for r in rows], dtype=np.float64)
    f = np.array([final[r] for r in rows], dtype=np.float64)
    d = f - b
    t = paired_t(list(d), level)
    assert t is not None
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, d.size, size=(draws, d.size))].mean(axis=1)
    alpha = 1 - level
    binary = bool(np.isin(np.concatenate([b, f]), (0.0, 1.0)).all())  # k = 1: each row solved or not
    up, down = int(((f == 1) & (b == 0)).sum()), int(((f == 0) & (b == 1)).sum())
    mcnemar = stats.binomtest(up, up + down, 0.5).pvalue if up + down else 1.0
    out = {
        "rows": len(rows),
        "base_pass@1": float(b.mean()),
        "final_pass@1": float(f.mean()),
        "gain": float(d.mean()),
        "paired_t": {"lo": t.lo, "hi": t.hi, "level": level},
        "paired_bootstrap": {"lo": float(np.quantile(boot, alpha / 2)), "hi": float(np.quantile(boot, 1 - alpha / 2)),
                             "level": level, "draws": draws, "seed": seed},
        "discordant": {"trained_only": up, "base_only": down, "both": int(((f == 1) & (b == 1)).sum()),
                       "neither": int(((f == 0) & (b == 0)).sum())},
        "mcnemar_exact_p": float(mcnemar),
        "per_row": [{"row": r, "base": base[r], "final": final[r]} for r in rows],
    }
    if not binary:  # k > 1: a row's rate is a share of its samples; McNemar's counts do not apply
        del out["discordant"], out["mcnemar_exact_p"]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
        return 2
    base, final = (json.loads(Path(p).read_text()) for p in argv)
    out = paired_gain(per_row(base), per_row(final))
    out["inputs"] = {"base": argv[0], "final": argv[1], "base_command": base.get("command"),
                     "final_command": final.get("command")}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
