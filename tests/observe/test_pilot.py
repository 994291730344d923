"""``mixrl.lab.study.pilot``: its statistics against float64 loops and SciPy, and a pilot read
back from data files written in the committed format."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from mixrl.lab.study import pilot

STUDY = {"collapse_drop": 0.15, "monitor": {"warmup_steps": 3, "early_steps": 5, "ema": 0.1, "reward_drop": 0.15,
                                            "kl_factor": 3.0, "format_error_frac": 0.5}}


def test_moving_average_is_the_trailing_mean() -> None:
    ys = list(np.random.default_rng(0).random(17))
    got = pilot.moving_average(ys, 5)
    for i in range(len(ys)):
        window = ys[max(0, i - 4): i + 1]
        assert got[i] == pytest.approx(sum(window) / len(window), abs=1e-15)


@pytest.mark.parametrize("a,b,want", [([1, 0, 0, 0], [0, 1, 1, 1], 2), ([0, 0, 1, 0], [1, 1, 0, 1], 4),
                                      ([1, 1, 1], [0, 0, 0], None), ([0, 0], [1, 1], 1), ([0, 0, 0], [1, 1, 0], None)])
def test_stays_below_is_the_first_index_of_the_last_run_below(a: list, b: list, want: int | None) -> None:
    assert pilot.stays_below(a, b) == want


def test_paired_over_tasks_is_scipys_paired_t_interval() -> None:
    rng = np.random.default_rng(1)
    a = {f"t{i}": [4, int(rng.integers(0, 5))] for i in range(40)}
    b = {f"t{i}": [4, int(rng.integers(0, 5))] for i in range(3, 43)}  # 37 tasks in common
    got = pilot.paired_over_tasks(a, b)
    common = sorted(set(a) & set(b))
    d = np.array([a[t][1] / 4 - b[t][1] / 4 for t in common], dtype=np.float64)
    lo, hi = stats.t.interval(0.95, d.size - 1, loc=d.mean(), scale=stats.sem(d))
    assert got is not None and got["tasks"] == 37
    assert got["estimate"] == pytest.approx(float(d.mean()), abs=1e-14)
    assert (got["lo"], got["hi"]) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    assert pilot.paired_over_tasks({"x": [4, 1]}, {"x": [4, 2]}) is None


def _write(out, name: str, rewards: list[float], final: dict, base: dict | None = None, kl: float = 0.1) -> None:
    n = len(rewards)
    steps = {"step": list(range(1, n + 1)), "rollout/reward": rewards, "time": [10.0 * i for i in range(n)],
             "precision/kl_k3/g": [kl] * n, "precision/ratio_oob/g": [0.01] * n, "share/samples/g": [1.0] * n,
             "precision/kl_k3": [kl] * n, "precision/tokens": [100.0] * n}
    data = {"run": {"name": name, "mode": "sync", "preset": name.split("/")[1], "seed": 0, "steps": n},
            "eval": {"k": 1, "final": final, "base": base or {}}, "steps": steps,
            "fp32": {"0": {"mean_reward": 0.2}, str(n): {"mean_reward": 0.5}} if base else {str(n): {"mean_reward": 0.5}}}
    f = out / "data" / (name + ".json")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(data))


def test_a_pilot_read_back_from_its_data_files(tmp_path) -> None:
    tasks = [f"h/{i}" for i in range(6)]
    base = {t: [4, 1] for t in tasks}
    _write(tmp_path, "mixed-sync/grpo/seed0", [0.1, 0.3, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2], {t: [4, 2] for t in tasks}, base)
    _write(tmp_path, "reference/on-policy/seed0", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], {t: [4, 3 + i % 2]
                                                                                       for i, t in enumerate(tasks)},
           kl=1e-9)
    res = pilot.pilot(tmp_path, "mixed-sync/grpo", "reference/on-policy", STUDY)
    arm, ref = res["arm"], res["reference"]
    assert arm["held_out_pass1"] == {"base": 0.25, "final": 0.5} and ref["held_out_pass1"]["final"] == 0.875
    assert arm["collapsed"] == [] and arm["monitor_first_flag"] is None
    assert arm["groups"]["g"]["kl_k3_first"] == pytest.approx(0.1) and arm["fp32_reward"] == {0: 0.2, 8: 0.5}
    ma_arm = pilot.moving_average([0.1, 0.3, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2])
    ma_ref = pilot.moving_average([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    assert res["arm_ma5_below_reference_from"] == pilot.stays_below(ma_arm, ma_ref) == 4
    d = res["final_pass1_arm_minus_reference"]
    assert d["estimate"] == pytest.approx(0.5 - 0.875) and d["tasks"] == 6 and d["hi"] < 0
    assert res["final_pass1_arm_minus_base"]["estimate"] == pytest.approx(0.25)
    assert math.isnan(arm["clipped_frac_first_last"][0])  # not in these files: NaN, not 0
    with pytest.raises(SystemExit, match="no data for"):
        pilot.pilot(tmp_path, "mixed-sync/sc", "reference/on-policy", STUDY)
