"""mixrl.runtime"""
