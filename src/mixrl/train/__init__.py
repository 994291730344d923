"""mixrl.train"""
