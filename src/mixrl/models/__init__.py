"""mixrl.models"""
