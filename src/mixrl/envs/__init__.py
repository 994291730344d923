"""mixrl.envs"""
