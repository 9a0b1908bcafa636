"""Operator kernels for hybridjax: a float32 reference, a portable XLA version and Pallas
kernels per operator, all behind one signature. This package imports nothing else from
`hybridjax`; it lives inside it only so that its installed name cannot collide with another
project's.
"""
