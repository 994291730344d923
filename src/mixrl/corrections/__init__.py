"""mixrl.corrections"""
