"""mixrl.sampling"""
