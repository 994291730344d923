import re


def final_number(completions, answer, **kwargs):
    """1.0 when the last number in the reply is the row's answer, else 0.0 (GSM8K-style; TRL's signature)."""
    rewards = []
    for completion, truth in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", completion.replace(",", ""))
        rewards.append(1.0 if numbers and numbers[-1] == truth else 0.0)
    return rewards
