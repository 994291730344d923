"""The typed configuration of one training run (``mixrl train``): the schema.

Every field has a description and a bound; ``mixrl.config.io`` reads a TOML
file plus ``--set key.path=value`` overrides into these models and reports an
invalid value with its dotted field path (``rollout.group_size: ...``).

This module imports only pydantic and the standard library: the CLI validates a
configuration before torch or Ray are imported. Values derived from user
settings (the sampler ``top_p`` taken from the loss preset, the resolved
``record`` mode, the in-flight prompt bound) live in ``Derived``, apart from the
settings themselves.

Example (the bundled demo is ``mixrl/configs/demo.toml``)::

    [rollout]
    group_size = 8
    prompts_per_step = 8

    [[fleet.groups]]
    name = "h100-fp8"
    profile = "h100-fp8"
    replicas = 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mixrl.config.presets import HEAD_K
from mixrl.records.generation import parse_record


class _Section(BaseModel):
    # Unknown keys are errors: a typo in a TOML file must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The policy that is trained and served."""

    path: str = Field(default="bundled", min_length=1, description='"bundled" (the small bundled policy), a HF model directory, a .gguf file (or a folder or "pkg:PACKAGE[/FILE]" resource holding one), or a hub id in the local HF cache')
    chat_template: str | None = Field(default=None, min_length=1, description="Jinja chat template file used instead of the tokenizer's own (needed when it has none)")


class EnvConfig(_Section):
    """The task family and environment options."""

    name: str = Field(default="calc", min_length=1, description="task family, as known to mixrl.envs.registry")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for make_env (max_turns, ...)")


class OverlongFilter(_Section):
    """DAPO overlong filtering: a truncated episode gets no loss and leaves its group's statistics."""

    type: Literal["filter"] = "filter"


class OverlongPenalty(_Section):
    """DAPO soft overlong punishment (arXiv 2503.14476 eq. 13), added to the reward before advantages."""

    type: Literal["penalty"] = "penalty"
    buffer: int = Field(default=16, ge=1, le=1 << 20, description="L_cache: the penalty ramps from 0 to -factor over the last `buffer` tokens of the budget")
    factor: float = Field(default=1.0, gt=0, le=100, description="penalty at the generation budget")


Overlong = Annotated[OverlongFilter | OverlongPenalty, Field(discriminator="type")]


class RolloutConfig(_Section):
    """How trajectories are sampled."""

    group_size: int = Field(default=8, ge=2, le=1024, description="G: trajectories per prompt (GRPO group)")
    prompts_per_step: int = Field(default=8, ge=1, le=4096, description="B: complete groups per trainer update")
    max_total_tokens: int = Field(default=160, ge=8, le=1 << 20, description="cap on prompt + generated + tool tokens of one episode")
    max_new_tokens: int = Field(default=48, ge=1, le=1 << 20, description="cap on tokens generated in one assistant turn")
    temperature: float = Field(default=1.0, gt=0, le=10, description="sampling temperature (corrections assume the same T in the trainer)")
    top_p: float | None = Field(default=None, gt=0, le=1, description="nucleus mass; None = the loss preset's sampler_top_p")
    record: str = Field(default="auto", description='which candidates of q to record: "auto" (support if top_p < 1 else head:K), "support", "head:K", "none"')
    head_k: int | None = Field(default=None, ge=1, le=4096, description='K for record = "auto" with full-vocabulary sampling; None = the preset\'s head_k')
    max_inflight_prompts: int | None = Field(default=None, ge=1, le=1 << 16, description="prompts being sampled at once (async); None = 2 * prompts_per_step")
    interrupt_tokens: int = Field(default=0, ge=0, le=1 << 20, description="> 0: generate each turn in pieces of this many tokens, so weights published mid-turn are loaded and the turn continues under them (partial rollouts; every token keeps its version and log q); 0 = off")
    dynamic_sampling: bool = Field(default=False, description="skip complete groups whose rewards are all equal (no signal) and sample more prompts in their place (DAPO)")
    overlong: Overlong | None = Field(default=None, description='episodes that reach the generation budget: {type="filter"} (no loss) or {type="penalty", buffer=.., factor=..} (DAPO); None = off')

    @field_validator("record")
    @classmethod
    def _record(cls, v: str) -> str:
        if v == "auto":
            return v
        try:
            parse_record(v)
        except ValueError:
            raise ValueError(f"must be 'auto', 'support', 'none' or 'head:K' with K > 0, got {v!r}") from None
        return v


class GroupConfig(_Section):
    """One sampler group: replicas of one precision profile."""

    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9._+-]+$", description="group name (metric suffix)")
    profile: str = Field(..., min_length=1, description="precision profile, as known to mixrl.sampling.profiles")
    replicas: int = Field(default=1, ge=0, le=256, description="replicas at start")
    min_replicas: int = Field(default=0, ge=0, le=256, description="autoscaler lower bound")
    max_replicas: int = Field(default=4, ge=1, le=256, description="autoscaler upper bound")
    overrides: dict[str, Any] = Field(default_factory=dict, description="profile fields to override (with_overrides), e.g. compute_dtype")
    accelerator_type: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="Ray: place replicas only on nodes of this accelerator type (H100, H200, B200, A100, ...); None = any node")
    num_gpus: float = Field(default=0.0, ge=0, le=64, description="Ray: GPUs reserved per replica")
    num_cpus: float = Field(default=1.0, ge=0, le=1024, description="Ray: CPUs reserved per replica")
    memory_gb: float = Field(default=0.0, ge=0, le=1 << 16, description="Ray: memory reserved per replica, GiB (0 = none)")
    cuda_devices: list[Annotated[int, Field(ge=0, le=1023)]] | None = Field(default=None, max_length=64, description="embedded: this host's CUDA devices the replicas take in turn, one each (None: every visible device in turn); a replica is on a GPU when num_gpus > 0 or this is set; Ray assigns devices itself")
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=0.95, description="vLLM: fraction of its GPU's memory one replica may take (None: vLLM's default 0.9); replicas and a trainer sharing a GPU are checked at start-up")

    @model_validator(mode="after")
    def _bounds(self) -> GroupConfig:
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"need min_replicas <= replicas <= max_replicas, got {self.min_replicas} <= "
                f"{self.replicas} <= {self.max_replicas}"
            )
        return self


class FixedScaling(_Section):
    """No autoscaling: replica counts change only through the fleet API."""

    type: Literal["fixed"] = "fixed"


class InflightScaling(_Section):
    """Keep in-flight sessions per replica near a target, within [min, max] replicas."""

    type: Literal["inflight"] = "inflight"
    target: float = Field(default=16.0, gt=0, le=1 << 16, description="in-flight sessions per replica to aim for")
    tolerance: float = Field(default=0.5, ge=0, le=10, description="act when load is outside target * (1 +- tolerance)")
    interval_s: float = Field(default=2.0, gt=0, le=3600, description="seconds between decisions")


Autoscaling = Annotated[FixedScaling | InflightScaling, Field(discriminator="type")]


class FleetConfig(_Section):
    """The sampler fleet: named groups of replicas, and how they scale."""

    groups: list[GroupConfig] = Field(
        default_factory=lambda: [GroupConfig(name="fp32", profile="fp32", replicas=1, min_replicas=1, max_replicas=4)],
        min_length=1,
        description="sampler groups",
    )
    autoscaler: Autoscaling = Field(default_factory=lambda: FixedScaling(), description="scaling policy")
    check_loads: bool = Field(
        default=False, description="debug: after every weights load, each replica samples one token after a few "
        "fixed prompts and its log q is compared with the trainer's for that version; a replica that serves other "
        "weights stops the run (needs trainer.world_size = 1 on the embedded backend with the trainer on the CPU, "
        "or Ray)")

    @model_validator(mode="after")
    def _unique(self) -> FleetConfig:
        names = [g.name for g in self.groups]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"group names must be unique, repeated: {sorted(dup)}")
        if sum(g.replicas for g in self.groups) < 1:
            raise ValueError("the fleet needs at least one replica at start")
        return self


class LossSection(_Section):
    """The loss: a named preset (mixrl.config.presets) plus field overrides."""

    preset: str = Field(default="sc", min_length=1, description="preset name (default sc: docs/corrections.md section 14)")
    overrides: dict[str, Any] = Field(default_factory=dict, description="LossConfig fields that replace the preset's")


class OptimConfig(_Section):
    """The trainer's optimizer and numerics."""

    lr: float = Field(default=1e-4, gt=0, le=1.0, description="AdamW learning rate")
    weight_decay: float = Field(default=0.0, ge=0, le=1.0, description="AdamW weight decay")
    grad_clip: float = Field(default=1.0, gt=0, le=1e6, description="global gradient-norm clip")
    precision: Literal["fp32", "bf16", "fp16"] = Field(default="fp32", description="trainer precision (fp32 on CPU; fp16 without loss scaling, single process)")
    epochs: int = Field(default=1, ge=1, le=64, description="optimizer passes over each batch (PPO epochs)")
    minibatches: int = Field(default=1, ge=1, le=4096, description="optimizer steps per epoch")
    micro_batch_tokens: int = Field(default=16384, ge=16, le=1 << 26, description="token budget of one forward/backward (rows x row length, padding included): bounds trainer activation memory whatever the batch size")
    forward_micro_batch_tokens: int | None = Field(default=None, ge=16, le=1 << 26, description="token budget of the no-grad pass that fixes old log-probs (epochs * minibatches > 1); None = micro_batch_tokens")
    packing: bool = Field(default=True, description="pack several trajectories per row (own position ids, no attention across them) instead of padding each to the longest")
    share_prefix: bool = Field(default=True, description="with packing: samples of one prompt share its tokens in a row (the prompt runs through the model once; 4D-mask attention only, not flash/flex or MoE routing records)")
    schedule: Literal["constant", "linear", "cosine"] = Field(default="constant", description="learning-rate schedule over runtime.steps, after warm-up")
    warmup_steps: int = Field(default=0, ge=0, le=1 << 24, description="updates of linear warm-up from 0 to lr")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1.0, description="linear/cosine: lr at the last update as a fraction of lr")


class LoraConfig(_Section):
    """LoRA adapters (peft): only the adapters train and checkpoint; samplers get merged weights."""

    rank: int = Field(default=16, ge=1, le=4096, description="adapter rank r")
    alpha: float = Field(default=32.0, gt=0, le=1e6, description="scaling numerator: the update is (alpha / r) B A")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, description="module names that get adapters (peft target_modules)")


class TrainerConfig(_Section):
    """Trainer ranks (FSDP2), their resources on Ray, and LoRA."""

    world_size: int = Field(default=1, ge=1, le=1024, description="trainer ranks; > 1 shards parameters, gradients and optimizer state with FSDP2 (gloo on CPU, NCCL on GPU)")
    reduce_dtype: Literal["fp32", "bf16"] = Field(default="fp32", description="FSDP2 gradient reduction dtype (the parameter dtype is optim.precision)")
    accelerator_type: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="Ray: place ranks only on nodes of this accelerator type; None = any node")
    num_gpus: float = Field(default=0.0, ge=0, le=64, description="Ray: GPUs reserved per rank (> 0: the rank trains on CUDA)")
    num_cpus: float = Field(default=1.0, ge=0, le=1024, description="Ray: CPUs reserved per rank")
    memory_gb: float = Field(default=0.0, ge=0, le=1 << 16, description="Ray: memory reserved per rank, GiB (0 = none)")
    lora: LoraConfig | None = Field(default=None, description="[trainer.lora]: train LoRA adapters instead of all weights; None = full fine-tuning")


class RayConfig(_Section):
    """Ray backend options."""

    address: str | None = Field(default=None, description="cluster to join; None = $RAY_ADDRESS or a new local cluster")
    num_cpus: int | None = Field(default=None, ge=1, le=4096, description="CPUs of a new local cluster")
    weight_transport: Literal["object_store", "broadcast"] = Field(default="object_store", description="how each weights version reaches the replicas: the object store (written once, quantized once per format), or broadcast over a process group from the trainer actor to each replica (NCCL between GPUs, else gloo; replicas quantize on load)")


class EvalConfig(_Section):
    """Held-out evaluation at the end of the run (pass@k)."""

    enabled: bool = Field(default=True, description="evaluate base and final policy on the held-out split")
    n_tasks: int = Field(default=64, ge=1, le=1 << 20, description="held-out tasks")
    n: int = Field(default=4, ge=1, le=1024, description="samples per task")
    k: int = Field(default=1, ge=1, le=1024, description="pass@k")
    seed: int = Field(default=1234, ge=0, description="evaluation seed (fixed across runs)")
    top_p: float = Field(default=1.0, gt=0, le=1, description="held-out sampling nucleus; 1.0 = the full distribution, whatever the training sampler's top_p")
    base: bool = Field(default=True, description="also evaluate the starting policy (for the gain)")

    @model_validator(mode="after")
    def _k(self) -> EvalConfig:
        if self.k > self.n:
            raise ValueError(f"k ({self.k}) must be <= n ({self.n})")
        return self


class RuntimeConfig(_Section):
    """The orchestrator: backend, scheduling mode, length, checkpoints."""

    backend: Literal["embedded", "ray"] = Field(default="embedded", description='how handles are made: "embedded" (one machine) or "ray"')
    sampler_workers: Literal["process", "thread"] = Field(default="process", description="embedded backend: sampler replicas as worker processes, or as threads of the orchestrator (reproducible schedule, for tests)")
    mode: Literal["async", "sync"] = Field(default="async", description="async: samplers never wait; sync: samplers wait for every update")
    max_staleness: int | None = Field(default=None, ge=0, le=1 << 20, description="bound on trainer version - token version; None = unbounded")
    staleness_policy: Literal["drop", "requeue"] = Field(default="drop", description="what happens to a group beyond max_staleness")
    steps: int = Field(default=40, ge=1, le=1 << 24, description="trainer updates")
    checkpoint_every: int = Field(default=0, ge=0, le=1 << 24, description="save every N steps (0 = only at the end and on Ctrl-C)")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="seed of data order, sampling and init")
    max_session_retries: int = Field(default=8, ge=0, le=1000, description="replica failures one session survives before it is infra_failed")
    torch_threads: int = Field(default=1, ge=1, le=1024, description="torch intra-op threads per process")
    ray: RayConfig = Field(default_factory=lambda: RayConfig(), description="Ray backend options")
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig(), description="final held-out evaluation")


class ObserveConfig(_Section):
    """Where results go."""

    run_dir: str = Field(default="runs/demo", min_length=1, description="output directory (config, metrics.jsonl, events, checkpoints, eval.json)")
    tensorboard: bool = Field(default=True, description="write TensorBoard event files")
    progress: bool = Field(default=True, description="show a progress bar")
    stop_on_collapse: bool = Field(default=False, description="end the run when the collapse monitor flags a collapse")
    wandb: dict[str, Any] | None = Field(default=None, description='Weights & Biases sink: wandb.init keywords, e.g. {project = "my-project"}')
    trackio: dict[str, Any] | None = Field(default=None, description='trackio sink: trackio.init keywords, e.g. {project = "my-project"}')


class DataConfig(_Section):
    """Your prompts: a dataset file, a saved dataset directory or a hub dataset id (mixrl.data)."""

    train: str | None = Field(default=None, min_length=1, description="JSON/JSONL, Parquet or CSV file, a save_to_disk directory, or a hub id in the local cache; None = env.name's own tasks")
    heldout: str | None = Field(default=None, min_length=1, description="held-out prompts (same forms as train); or use heldout_fraction")
    heldout_fraction: float | None = Field(default=None, gt=0, lt=1, description="share of train rows held out by a seeded split (when heldout is unset)")
    prompt_key: str = Field(default="prompt", min_length=1, description="column with the prompt: a string, or a list of chat messages")
    train_split: str = Field(default="train", min_length=1, description="split to read when train is a hub id or a saved DatasetDict")
    heldout_split: str = Field(default="test", min_length=1, description="split to read when heldout is a hub id or a saved DatasetDict")
    shuffle: bool = Field(default=True, description="seeded shuffle of the train rows, a new order every epoch")

    @model_validator(mode="after")
    def _heldout(self) -> DataConfig:
        if self.heldout is not None and self.heldout_fraction is not None:
            raise ValueError("set heldout or heldout_fraction, not both")
        if self.train is None and (self.heldout is not None or self.heldout_fraction is not None):
            raise ValueError("heldout / heldout_fraction need train")
        return self


class RewardConfig(_Section):
    """Reward functions (mixrl.envs.rewards): TRL's signature or verl's compute_score."""

    function: str | None = Field(default=None, min_length=1, description='one reward function: "reward.py:exact_match" or "package.module:fn"')
    functions: list[str] = Field(default_factory=list, description="several reward functions (summed with weights)")
    weights: list[float] | None = Field(default=None, description="one weight per function (default 1 each)")
    on_error: Literal["fail", "skip"] = Field(
        default="fail", description='a reward function that raises or returns NaN/None: "fail" stops the run '
        'with one line (exit 2); "skip" leaves the episode out (status reward_failed, counted)')

    @model_validator(mode="after")
    def _one_form(self) -> RewardConfig:
        if self.function is not None and self.functions:
            raise ValueError("set function or functions, not both")
        n = len(self.specs())
        if self.weights is not None and len(self.weights) != n:
            raise ValueError(f"weights has {len(self.weights)} entries for {n} functions")
        return self

    def specs(self) -> list[str]:
        """The configured reward functions as a list of specs (``function`` or ``functions``)."""
        return [self.function] if self.function is not None else list(self.functions)


class RunConfig(_Section):
    """One training run."""

    model: ModelConfig = Field(default_factory=lambda: ModelConfig())
    env: EnvConfig = Field(default_factory=lambda: EnvConfig())
    rollout: RolloutConfig = Field(default_factory=lambda: RolloutConfig())
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    loss: LossSection = Field(default_factory=lambda: LossSection())
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig())
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig())
    runtime: RuntimeConfig = Field(default_factory=lambda: RuntimeConfig())
    observe: ObserveConfig = Field(default_factory=lambda: ObserveConfig())
    data: DataConfig = Field(default_factory=lambda: DataConfig())
    reward: RewardConfig = Field(default_factory=lambda: RewardConfig())

    @model_validator(mode="after")
    def _dataset_env(self) -> RunConfig:
        # With your own data, the environment defaults to the dataset one (reward functions on the reply).
        if self.data.train is not None and "name" not in self.env.model_fields_set:
            self.env.name = "dataset"
        return self


@dataclass(frozen=True)
class Derived:
    """Values computed from the settings (never set by the user)."""

    top_p: float  # sampler nucleus mass actually used
    record: str  # "support" | "head:K" | "none"
    max_inflight_prompts: int


def derive(cfg: RunConfig, preset_top_p: float = 1.0, preset_head_k: int = HEAD_K) -> Derived:
    """Resolve ``top_p`` (explicit or the preset's), ``record`` and the in-flight bound."""
    top_p = cfg.rollout.top_p if cfg.rollout.top_p is not None else preset_top_p
    rec = cfg.rollout.record
    if rec == "auto":
        rec = "support" if top_p < 1.0 else f"head:{cfg.rollout.head_k or preset_head_k}"
    inflight = cfg.rollout.max_inflight_prompts or 2 * cfg.rollout.prompts_per_step
    return Derived(top_p=top_p, record=rec, max_inflight_prompts=inflight)
