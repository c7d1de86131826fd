"""A decode step's pieces: block inputs, draft trees, vocab-parallel merges, acceptance, penalties, recurrent state."""
