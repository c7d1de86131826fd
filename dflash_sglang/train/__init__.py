"""DFlash drafter training recipe (see recipes/training.md)."""
