"""mixrl.lab.bench"""
