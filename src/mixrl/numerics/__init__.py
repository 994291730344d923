"""mixrl.numerics"""
