"""Operator kernels for hybridjax: a float32 reference, a portable XLA version and (later) Pallas
kernels per operator, all behind one signature. This package imports nothing from `hybridjax`.
"""
