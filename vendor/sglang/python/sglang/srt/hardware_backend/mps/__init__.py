"""Apple MPS SRT Providers"""
