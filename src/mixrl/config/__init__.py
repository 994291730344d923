"""mixrl.config"""
