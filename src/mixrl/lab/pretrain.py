"""``mixrl pretrain``: build the bundled tokenizer and policy, warm-start it by SFT.

The warm start is supervised fine-tuning on demonstrations of the bundled
tasks (train split only; held-out tasks are never seen): chat-formatted
transcripts, loss on the assistant tokens only (tool output, prompts and
reminders are context). The demonstrations are deliberately mixed:

- calc: correct tool use (one call, or two calls for three operands), a
  reply without a call followed by the reminder and recovery, mistyped calls
  (imperfect), and a large share of *direct* answers with no tool call. The
  value of a direct answer is masked out of the loss: the policy learns that
  it sometimes answers without the tool, but not digits it cannot compute
  (imitating them only adds noise that delays learning to copy), so those
  answers are right only by luck;
- upper (only when ``p_calc < 1``; off by default, see ``Recipe``): correct
  uppercased words and some with one letter left lowercase.

So the base policy answers directly in about a third of the calc episodes
(it over-produces the 23% of the demonstrations),
and its tool path is under-trained: held-out success lands in the 10-60%
range, and RL has an easy, fast gain (prefer the tool: one decision token;
copy exactly) with clear headroom.

Deterministic given the recipe (seed included): data from ``random.Random``
seeded by the recipe, weights from ``torch.manual_seed``, a fixed thread
count. The output directory is written aside and renamed into place.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from mixrl.models.recipe import RECIPE_VERSION, Recipe


def _pick(rng: random.Random, weighted: tuple[tuple[str, float], ...]) -> str:
    names, ws = zip(*weighted, strict=True)
    return rng.choices(names, weights=ws)[0]


def demonstrations(recipe: Recipe, chat: Any, n: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (input ids, labels) pairs; labels are -100 outside assistant replies."""
    from mixrl.envs import calc, upper

    rng = random.Random(f"pretrain/{recipe.seed}")
    out = []
    n_calc = n_up = 0
    for _ in range(n):
        if rng.random() < recipe.p_calc:
            task = calc.make_task(recipe.seed, "train", n_calc)
            n_calc += 1
            turns = calc.demo_turns(task, rng, _pick(rng, recipe.calc_styles))
        else:
            task = upper.make_task(recipe.seed, "train", n_up)
            n_up += 1
            turns = upper.demo_turns(task, rng, _pick(rng, recipe.upper_styles))
        ids = chat.prompt(task.data["question"])
        labels = [-100] * len(ids)
        for role, text in turns:
            if role in ("assistant", "assistant_guess"):
                piece = chat.assistant(text)
                lab = list(piece)
                if role == "assistant_guess":  # supervise the tags, not the guessed value
                    lab = [lab[0]] + [-100] * (len(lab) - 3) + lab[-2:]
                ids, labels = ids + piece, labels + lab
            else:
                piece = chat.tool_result(text) if role == "tool" else chat.user_turn(text)
                ids, labels = ids + piece, labels + [-100] * len(piece)
        out.append((ids, labels))
    return out


def batches(recipe: Recipe, data: list[tuple[list[int], list[int]]]) -> list[list[tuple[list[int], list[int]]]]:
    """Split ``data`` into batches of similar length (less padding: ~2x faster on CPU).

    Sorted by length within windows of 8 batches, then the batch order is
    shuffled with the recipe's seed, so lengths do not drift over training.
    """
    rng = random.Random(f"batches/{recipe.seed}")
    w = 8 * recipe.batch
    out = []
    for i in range(0, len(data), w):
        win = sorted(data[i : i + w], key=lambda x: len(x[0]))
        out += [win[j : j + recipe.batch] for j in range(0, len(win), recipe.batch)]
    rng.shuffle(out)
    return out


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    L = max(len(x) for x, _ in examples)
    ids = torch.full((len(examples), L), pad_id, dtype=torch.long)  # [B, L]
    lab = torch.full((len(examples), L), -100, dtype=torch.long)  # [B, L]
    att = torch.zeros((len(examples), L), dtype=torch.long)  # [B, L]
    for i, (x, y) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        lab[i, : len(y)] = torch.tensor(y)
        att[i, : len(x)] = 1
    return ids, lab, att


def pretrain(recipe: Recipe, out: str | Path, log: Any = print) -> dict[str, Any]:
    """Train the policy of ``recipe`` and save model + tokenizer + recipe.json to ``out``."""
    import torch
    from transformers import Qwen3ForCausalLM

    from mixrl.models.chat import ChatFormat
    from mixrl.models.policy import qwen3_config
    from mixrl.models.tokenizer import build_tokenizer

    t0 = time.perf_counter()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        tok = build_tokenizer()
        chat = ChatFormat(tok)
        data = batches(recipe, demonstrations(recipe, chat, recipe.steps * recipe.batch))
        torch.manual_seed(recipe.seed)
        cfg = qwen3_config(
            len(tok), layers=recipe.layers, hidden=recipe.hidden, heads=recipe.heads,
            kv_heads=recipe.kv_heads, intermediate=recipe.intermediate,
            pad_id=tok.pad_token_id, eos_id=chat.end_of_turn_id,
        )
        model = Qwen3ForCausalLM(cfg)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98),
                                weight_decay=recipe.weight_decay)

        def lr_at(step: int) -> float:  # linear warmup, cosine to 10%
            if step < recipe.warmup:
                return recipe.lr * (step + 1) / recipe.warmup
            frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
            return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(frac * torch.pi)).item()))

        losses = []
        for step in range(recipe.steps):
            ids, lab, att = _batch(data[step], tok.pad_token_id)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            logits = model(input_ids=ids, attention_mask=att).logits  # [B, L, V]
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=-100
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if log and (step % 50 == 0 or step == recipe.steps - 1):
                log(f"pretrain step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - t0:6.1f}s")
        model.eval()
        wall = time.perf_counter() - t0
        tail = losses[-20:]
        meta = {
            "recipe": dataclasses.asdict(recipe), "recipe_version": RECIPE_VERSION,
            "digest": recipe.digest(), "final_loss": sum(tail) / len(tail), "wall_s": wall,
            "params": sum(p.numel() for p in model.parameters()),
            "weights_sha256": weights_digest(model),
            "torch": torch.__version__,
        }
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / "recipe.json").write_text(json.dumps(meta, indent=2))
        if out.exists():  # --force: move the old one aside first, then swap
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        return meta
    finally:
        torch.set_num_threads(prev_threads)


def weights_digest(model: Any) -> str:
    """sha256 over every parameter's bytes, in name order (reproducibility checks)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def param_stats(model: Any) -> dict[str, list[float]]:
    """Per tensor: [sum, sum of |x|] in float64 (compares two builds within a tolerance)."""
    return {name: [float(t.double().sum()), float(t.double().abs().sum())]
            for name, t in sorted(model.state_dict().items())}


def record_check(recipe: Recipe, out: str | Path, steps: int, log: Any = print) -> dict[str, Any]:
    """Build ``recipe`` shortened to ``steps`` steps and record its digest in ``out/recipe.json``.

    A full rebuild takes minutes; the short one lets a test rebuild the same
    code path quickly and compare against a digest recorded beside the weights.
    """
    import tempfile

    from mixrl.models.policy import load_policy

    short = dataclasses.replace(recipe, steps=steps)
    with tempfile.TemporaryDirectory() as tmp:
        pretrain(short, Path(tmp) / "p", log=log)
        model, _ = load_policy(Path(tmp) / "p")
        check = {"steps": steps, "digest": short.digest(), "weights_sha256": weights_digest(model),
                 "param_stats": param_stats(model)}
    meta_path = Path(out) / "recipe.json"
    meta = json.loads(meta_path.read_text())
    meta["check"] = check
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return check


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="recipe seed (data and init)")
    parser.add_argument("--out", default=None, help="output dir (default: the cache, "
                        "$MIXRL_HOME/policy-<recipe hash>; src/mixrl/models/bundled refreshes the shipped copy)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the output exists")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    parser.add_argument("--check-steps", type=int, default=0,
                        help="also record the digest of a build shortened to this many steps "
                        "(what the shipped policy's rebuild test compares against)")


def main(args: argparse.Namespace) -> int:
    from mixrl.models.shipped import mixrl_home

    recipe = Recipe(seed=args.seed)
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit(f"mixrl pretrain: --steps must be >= 1, got {args.steps}")
        recipe = dataclasses.replace(recipe, steps=args.steps)
    out = Path(args.out) if args.out else mixrl_home() / f"policy-{recipe.digest()}"
    if not build_locked(recipe, out, force=args.force):
        print(f"{out} exists (recipe {recipe.digest()}); --force rebuilds it")
        return 0
    if args.check_steps > 0:
        record_check(recipe, out, args.check_steps)
    meta = json.loads((out / "recipe.json").read_text())
    print(f"saved {out}  params {meta['params']:,}  final loss {meta['final_loss']:.4f}  "
          f"wall {meta['wall_s']:.1f}s")
    return 0


def build_locked(recipe: Recipe, out: Path, force: bool = False) -> bool:
    """Pretrain ``recipe`` into ``out`` under a file lock; False if it was already built."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds it built
        if (out / "recipe.json").exists() and not force:
            return False
        pretrain(recipe, out)
        return True


def ensure_bundled(data_dir: str | Path | None = None, seed: int = 0) -> Path:
    """The bundled policy for ``seed``, built into the cache first when neither the shipped copy
    nor a cached build is that recipe's (``mixrl.models.shipped.bundled_policy_path``)."""
    from mixrl.models.shipped import bundled_policy_path, cached_policy_path

    try:
        return bundled_policy_path(data_dir, seed)
    except FileNotFoundError:
        out = cached_policy_path(data_dir, seed)
        build_locked(Recipe(seed=seed), out)
        return out
