"""mixrl.train: the trainer.

    batch       Trajectory records -> padded tokens + flat per-position loss tensors
    trainer     Trainer: chunked log-probs, compute_loss, shared denominator, AdamW, versions
    checkpoint  atomic checkpoints (write aside, rename, atomic ``latest`` pointer)

Modules are imported where used (``from mixrl.train.trainer import Trainer``) so
that reading a checkpoint does not import transformers.
"""
