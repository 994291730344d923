"""mixrl.rollout"""
