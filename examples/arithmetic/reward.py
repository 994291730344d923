import re


def exact_match(completions, answer, **kwargs):
    """1.0 when the reply's <answer>...</answer> is the row's answer, else 0.0 (TRL's signature)."""
    rewards = []
    for completion, truth in zip(completions, answer, strict=True):
        m = re.search(r"<answer>(.*?)</answer>", completion)
        rewards.append(1.0 if m and m.group(1).strip() == truth else 0.0)
    return rewards
