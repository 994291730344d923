"""mixrl.observe"""
