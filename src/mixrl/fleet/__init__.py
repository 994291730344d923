"""mixrl.fleet"""
