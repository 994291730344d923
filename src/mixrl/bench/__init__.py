"""mixrl.bench"""
