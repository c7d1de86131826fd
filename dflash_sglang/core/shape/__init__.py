"""Choosing the verify shape: the adaptive table, the goodput controller and its acceptance models."""
